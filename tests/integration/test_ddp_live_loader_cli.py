"""`disttrain ddp --ddp-recovery live --loader-workers 1`: each rank's batches are loaded
ahead by a worker process, planned again for every generation. A rank SIGKILLed
mid-epoch: the survivors redo its step with their new split (batches off the workers'
plan are loaded in the rank itself), every global batch is applied once, and the run
trains on the same tensors as an undisturbed run without workers."""

from __future__ import annotations

import pytest
from conftest import run_ddp

WORLD_SIZE, BATCH, EPOCHS = 3, 16, 3
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


@pytest.mark.slow
@pytest.mark.timeout(560)
@pytest.mark.extended  # live loss and rejoin: test_ddp_live_cli; loader workers: test_ps_cluster
def test_loader_workers_survive_a_lost_rank_and_apply_each_batch_once(tmp_path):
    undisturbed = run_ddp(tmp_path / "undisturbed", *ARGS)
    summary = run_ddp(tmp_path / "killed", *ARGS, "--loader-workers", 1, "--max-restarts", 0,
                  "--inject", "kill:rank=2:step=12")
    assert [r["members"] for r in summary["live_recoveries"]] == [[0, 1]]
    assert summary["steps"] == undisturbed["steps"]
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.005
    # The workers served the batches on their plan: the survivors' logs say how many.
    served = [line for slot in (0, 1) for line in (tmp_path / "killed" / "logs" / f"rank{slot}.log")
              .read_text().splitlines() if "batches loaded ahead" in line]
    assert served and all(" 0 batches loaded ahead" not in line for line in served)
