"""`disttrain ddp --ddp-recovery live` with local updates (`training.sync_every`): a rank
SIGKILLed mid-round; the survivors go back to the round's start (their half-trained
models are given up with the lost one's), redo its global batches among themselves in
their own processes, and take the rank back at a round boundary. Every global batch is
applied once, and the model learns as the undisturbed run's."""

from __future__ import annotations

import pytest
from conftest import run_ddp

WORLD_SIZE, BATCH, EPOCHS, SYNC_EVERY = 3, 16, 8, 4
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", f"training.sync_every={SYNC_EVERY}",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


@pytest.mark.slow
@pytest.mark.timeout(560)
@pytest.mark.extended  # live loss: test_ddp_live_cli; rounds redone: test_ps_local_round_redo
def test_a_rank_killed_mid_round_sends_the_survivors_back_to_the_rounds_start(tmp_path):
    undisturbed = run_ddp(tmp_path / "undisturbed", *ARGS)
    steps_per_epoch = undisturbed["steps"] // EPOCHS
    rounds_per_epoch = -(-steps_per_epoch // SYNC_EVERY)  # an epoch's last step ends a round
    assert undisturbed["sync_every"] == SYNC_EVERY
    assert undisturbed["local_rounds"] == EPOCHS * rounds_per_epoch
    assert (undisturbed["samples_lost"], undisturbed["samples_applied_twice"]) == (0, 0)
    assert undisturbed["final_accuracy"] > 0.9

    # Rank 1 dies after step 10, the second step of the round of steps 9 to 12 (the
    # round began after step 8). Rank 0 straggles, so the run outlasts the new process's start.
    summary = run_ddp(tmp_path / "killed", *ARGS, "--max-restarts", 1, "--inject", "kill:rank=1:step=10",
                  "--inject", "slow:rank=0:factor=10")
    shrink, *rest = summary["live_recoveries"]
    assert shrink["kind"] == "shrink" and shrink["members"] == [0, 2]
    assert shrink["step"] == 8  # the round's start, not the step the survivors had reached
    assert summary["samples_redone"] > 0  # the survivors' steps of the given-up round
    grows = [r for r in rest if r["kind"] == "grow"]
    assert grows and grows[-1]["members"] == [0, 1, 2]
    assert all((r["step"] % steps_per_epoch) % SYNC_EVERY == 0 for r in grows)  # at round boundaries
    for slot in (0, 2):  # the survivors were never restarted
        assert summary["rank_pids"][str(slot)] == [summary["final_pids"][str(slot)]]
    assert len(summary["rank_pids"]["1"]) == 2
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] == undisturbed["steps"] and summary["local_rounds"] == undisturbed["local_rounds"]
    # Not the same model: while two ranks train, each one's round covers a larger piece.
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.02
