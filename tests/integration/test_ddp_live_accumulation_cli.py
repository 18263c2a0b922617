"""`disttrain ddp --ddp-recovery live --grad-accumulation-steps 2`: each step takes two
global batches (micro-batches, then one all-reduce). A rank SIGKILLed mid-epoch: the
survivors redo both batches of the failed step, every global batch is applied once, and
the run ends as accurate as the undisturbed one."""

from __future__ import annotations

import math

import pytest
from conftest import run_ddp

from disttrain.config import TrainingConfig
from disttrain.data import load_datasets

WORLD_SIZE, BATCH, EPOCHS, MICRO = 3, 16, 4, 2
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--grad-accumulation-steps", MICRO,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.006",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


def batches_per_epoch() -> int:
    train_set, _ = load_datasets(TrainingConfig(dataset="digits"))
    return len(train_set) // (BATCH * WORLD_SIZE)


@pytest.mark.slow
@pytest.mark.timeout(560)
@pytest.mark.extended  # live loss: test_ddp_live_cli; accumulation: test_ddp_equivalence
def test_accumulated_steps_are_redone_whole_after_a_loss(tmp_path):
    undisturbed = run_ddp(tmp_path / "undisturbed", *ARGS)
    batches = batches_per_epoch()
    # The epoch's last step takes what is left when the batches do not split evenly.
    assert undisturbed["steps"] == EPOCHS * math.ceil(batches / MICRO)
    assert undisturbed["samples_applied"] == EPOCHS * batches * BATCH * WORLD_SIZE
    assert undisturbed["final_accuracy"] > 0.9

    summary = run_ddp(tmp_path / "killed", *ARGS, "--max-restarts", 0, "--inject", "kill:rank=2:step=9")
    assert [r["members"] for r in summary["live_recoveries"]] == [[0, 1]]
    assert summary["steps"] == undisturbed["steps"]
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.005
