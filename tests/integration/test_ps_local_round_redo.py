"""Parameter-server runs with local updates that lose rounds, from the chaos scenario
`ps-local` at a smaller size (sync mode, 2 shards, 4 inner steps a round): a shard server
restored from a checkpoint older than rounds the workers already pushed, and a worker
never restarted whose rounds the others take over. Real processes, a fault injected at
an exact point, and each test ends by checking state: every shard's newest checkpoint
(the chaos invariants: every sample applied once, the same ledger on every shard, every
worker done, one step) and the summary.

Found by `disttrain chaos`, ps-local seed 207: a shard restored from its checkpoint lacked
the rounds applied after it, and the workers only logged that local updates cannot redo
a round, so the run ended with 960 samples lost on that shard. A lost round is now redone
like a lost block: a worker trains the round's batches again from the parameters of the
moment and pushes the pseudo-gradient as a redo to the shards that lack it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from disttrain.chaos.invariants import check_ps_ledgers
from disttrain.chaos.runner import TRAINING_SEED
from disttrain.chaos.scenarios import scenario

# 512 samples a worker in batches of 16: 32 batches an epoch, 8 rounds of 4. A shard's
# version counts rounds (and redone rounds); it checkpoints every 5 versions and at each
# epoch's end.
SCENARIO = replace(scenario("ps-local"), epochs=2, train_samples=1024, checkpoint_interval=5)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_chaos_ps_local_seed207_a_restored_shard_gets_its_lost_rounds_redone(tmp_path, cli):
    # Shard 1 dies as it applies round 7 (before its answer leaves) and comes back from its
    # version-5 checkpoint: the workers push round 7 again there, but round 6 of both
    # (4 batches each: blocks 23 and 55) is missing there and not on shard 0. Each worker
    # redoes its round at the epoch's end.
    fault = "kill:server=1:step=7"
    line = SCENARIO.command_line(tmp_path / "logs", tmp_path / "ckpt", TRAINING_SEED)
    result = cli(*line[3:], "--inject", fault, timeout=450)  # past `python -m disttrain`
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_ps_ledgers(SCENARIO, tmp_path / "ckpt") == []
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert [f["process"] for f in summary["failures"]] == ["server1"], summary["failures"]
    assert summary["samples_lost"] == 0
    assert summary["samples_applied"] == SCENARIO.total_samples
    # Only rounds the restore lost were redone (rounds 6 and 7 at most, 4 batches of 16 of
    # each worker). A redo numbered by the worker's step (32 at the epoch's end) rather
    # than its round (8) made shard 1 keep 32 as its last step and turn every round of
    # the next epoch away as a duplicate, each then redone alone at the run's end.
    assert 2 * 4 * 16 <= summary["samples_redone"] <= 2 * 2 * 4 * 16


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_rounds_of_a_reassigned_worker_are_taken_over_whole_with_local_updates(tmp_path, cli):
    # 3 workers of 320 samples in batches of 32: 10 batches an epoch, rounds of batches
    # 0-3, 4-7 and 8-9. Worker 2 dies in its step 6, in its second round (nothing of it
    # pushed), and is never restarted: once reassigned, the others take over its last two
    # rounds of epoch 0 and its three of epoch 1, each round by the worker whose share
    # holds its last batch (they only logged that local updates cannot take a block over).
    reassigned = replace(scenario("ps-local"), workers=3, epochs=2, train_samples=960, batch_size=32,
                         checkpoint_interval=5, reassign=True, max_restarts=0)
    line = reassigned.command_line(tmp_path / "logs", tmp_path / "ckpt", TRAINING_SEED)
    result = cli(*line[3:], "--inject", "kill:worker=2:step=6", timeout=450)
    assert result.returncode == 0, result.stderr[-3000:]
    # every invariant, but that worker 2 (away, never back) is not among the workers done
    assert check_ps_ledgers(reassigned, tmp_path / "ckpt") == [f"shard {shard}: workers [0, 1] done of 3"
                                                                 for shard in range(2)]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["reassigned_workers"] == [2]
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == reassigned.total_samples
    assert summary["samples_taken_over"] == (6 + 10) * 32
