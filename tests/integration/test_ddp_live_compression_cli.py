"""`disttrain ddp --ddp-recovery live --compression-enabled`: top-k with error feedback on
the live group's own all-reduce. A rank SIGKILLed mid-epoch: the survivors redo its step
and finish (their residuals start again at zero), every global batch is applied once, and
the accuracy stays within tolerance of the undisturbed compressed run."""

from __future__ import annotations

import pytest
from conftest import run_ddp

WORLD_SIZE, BATCH, EPOCHS = 3, 16, 4
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--compression-enabled", "--compression-type", "topk", "--set", "compression.ratio=0.1",
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(560)
def test_topk_live_run_loses_a_rank_and_keeps_its_accuracy(tmp_path):
    undisturbed = run_ddp(tmp_path / "undisturbed", *ARGS)
    assert (undisturbed["samples_lost"], undisturbed["samples_applied_twice"]) == (0, 0)
    assert undisturbed["final_accuracy"] > 0.85  # compressed, it still learns

    summary = run_ddp(tmp_path / "killed", *ARGS, "--max-restarts", 0, "--inject", "kill:rank=2:step=12")
    assert [r["members"] for r in summary["live_recoveries"]] == [[0, 1]]
    assert set(summary["final_pids"]) == {"0", "1"}
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] == undisturbed["steps"]
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.02
