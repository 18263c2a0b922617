"""A live DDP run of 2 ranks on a `shards:` folder, as a user starts it: each rank reads
its pieces of the global batches shard by shard (the shard order), its reader told the
shards ahead, so its steps read none themselves (the reader's counts in each rank's log:
only the evaluation's test shards are read on demand),
and every global batch of every epoch is applied once."""

from __future__ import annotations

import json
import re

import pytest

from disttrain.data.datasets import digits
from disttrain.data.shards import write_shards

SHARD, BATCH, EPOCHS, RANKS = 64, 16, 3, 2
READER = re.compile(r"training\.dataset: (\d+) shards read ahead, (\d+) read by the steps themselves")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.extended  # live runs: test_ddp_live_cli; shard order: test_data_shards_cli
def test_a_live_run_on_shards_reads_them_in_the_shard_order(cli, tmp_path):
    train, test = digits()
    spec = write_shards(tmp_path / "digits", (train.images.numpy(), train.labels.numpy()),
                        (test.images.numpy(), test.labels.numpy()), SHARD)
    logs = tmp_path / "logs"
    result = cli("ddp", "--ddp-recovery", "live", "--world-size", RANKS, "--dataset", spec,
                 "--model", "mlp", "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 3,
                 "--num-threads", 1, "--timeout-s", 120, "--data-dir", tmp_path / "data",
                 "--log-dir", logs, "--checkpoint-dir", tmp_path / "ckpt",
                 "--set", "training.num_shards_in_memory=3", "--set", "training.num_shards_ahead=2",
                 timeout=250)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    global_batch = BATCH * RANKS
    assert summary["samples_applied"] == EPOCHS * (len(train.labels) // global_batch * global_batch)
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    for rank in range(RANKS):
        counts = [tuple(map(int, found)) for found in READER.findall((logs / f"rank{rank}.log").read_text())]
        # one line per epoch start after the first (the epoch before's reads)
        assert len(counts) >= EPOCHS - 1, counts
        # In the shard order an epoch reads each of digits' 23 training shards about once,
        # ahead, not once per batch (a plain permutation's pieces touch ~10 shards each);
        # what the process reads itself is the evaluation's (the test split's 6 shards).
        assert all(12 <= ahead <= 2 * 23 and on_demand <= 6 for ahead, on_demand in counts), counts
