"""`disttrain ddp --ddp-recovery live --compression-enabled`: top-k with error feedback on
the live group's own all-reduce. A rank SIGKILLed mid-epoch: the survivors redo its step
and finish (their residuals start again at zero), every global batch is applied once, and
the accuracy stays within tolerance of the undisturbed compressed run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORLD_SIZE, BATCH, EPOCHS = 3, 16, 4
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--compression-enabled", "--compression-type", "topk", "--set", "compression.ratio=0.1",
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


def run(cli, folder: Path, *extra) -> dict:
    result = cli("ddp", *ARGS, "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt", *extra,
                 timeout=250)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(560)
def test_topk_live_run_loses_a_rank_and_keeps_its_accuracy(cli, tmp_path):
    undisturbed = run(cli, tmp_path / "undisturbed")
    assert (undisturbed["samples_lost"], undisturbed["samples_applied_twice"]) == (0, 0)
    assert undisturbed["final_accuracy"] > 0.85  # compressed, it still learns

    summary = run(cli, tmp_path / "killed", "--max-restarts", 0, "--inject", "kill:rank=2:step=12")
    assert [r["members"] for r in summary["live_recoveries"]] == [[0, 1]]
    assert set(summary["final_pids"]) == {"0", "1"}
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] == undisturbed["steps"]
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.02
