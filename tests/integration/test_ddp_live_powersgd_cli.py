"""`disttrain ddp --ddp-recovery live --compression-type powersgd`: a rank SIGKILLed
mid-epoch rejoins the survivors with their PowerSGD state (iteration, P, Q), so its
collectives match theirs (a fresh hook all-reduces the whole buffer where they send P and
Q, and gloo aborts on the mismatch). Every global batch is applied once and the accuracy
stays within tolerance of the undisturbed compressed run."""

from __future__ import annotations

import pytest
from conftest import run_ddp

WORLD_SIZE, BATCH, EPOCHS = 3, 16, 3
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--compression-enabled", "--compression-type", "powersgd", "--set", "compression.powersgd_rank=2",
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_powersgd_live_run_takes_a_killed_rank_back(tmp_path):
    undisturbed = run_ddp(tmp_path / "undisturbed", *ARGS)
    assert (undisturbed["samples_lost"], undisturbed["samples_applied_twice"]) == (0, 0)
    assert undisturbed["final_accuracy"] > 0.85  # compressed, it still learns

    # A survivor hangs for 20 s soon after (SIGSTOP, then SIGCONT; its peer waits in the
    # all-reduce), so the run outlasts the killed rank's new process starting and asking to
    # join, and the hang leaves the cores to that start.
    summary = run_ddp(tmp_path / "killed", *ARGS, "--max-restarts", 1, "--inject", "kill:rank=2:step=10",
                  "--inject", "stop:rank=1:step=14:for=20s")
    shrink, *rest = summary["live_recoveries"]
    assert shrink["kind"] == "shrink" and shrink["members"] == [0, 1]
    grows = [r for r in rest if r["kind"] == "grow"]
    assert grows and grows[-1]["members"] == [0, 1, 2]  # the rejoined rank trained with them
    assert len(summary["rank_pids"]["2"]) == 2 and summary["final_pids"]["2"] == summary["rank_pids"]["2"][1]
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] == undisturbed["steps"]
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.02
