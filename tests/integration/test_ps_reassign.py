"""A parameter-server worker killed and never restarted (`--max-restarts 0`): once the
coordinator reassigns it (`--reassign-after`), the other workers take over its blocks,
and the run ends with every sample applied once on every shard. Real processes from the
CLI; the checks read the servers' ledgers (through the summary) and the coordinator's
registry.

3 workers x 10 batches of 32 an epoch, 2 epochs, 2 shards; a worker dies after its step
4, so the others take over the rest of its first epoch and all of its second.
"""

import json

import pytest
from conftest import VARIANT

from disttrain.coordinator.registry import read_status
from disttrain.core.forking import FORK_SERVER_ENV

TRAIN, TEST, BATCH, EPOCHS, WORKERS = 960, 200, 32, 2, 3
BATCHES = TRAIN // WORKERS // BATCH  # a worker's batches an epoch
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", str(WORKERS), "--servers", "2",
        "--batch-size", str(BATCH), "--max-train-samples", str(TRAIN), "--max-test-samples", str(TEST),
        "--num-epochs", str(EPOCHS), "--checkpoint-interval", "5", "--heartbeat-interval", "0.2",
        "--heartbeat-timeout", "1.5", "--seed", "3"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,killed", [("sync", 2),
                                         pytest.param("async", 2, marks=VARIANT),
                                         pytest.param("ssp", 2, marks=VARIANT),
                                         pytest.param("sync", 0, marks=pytest.mark.slow)])
@pytest.mark.slow  # a cluster run to its end: make test runs it
def test_a_worker_never_restarted_has_its_blocks_done_by_the_others(tmp_path, cli, mode, killed):
    # killed 0: worker 0 writes the summary, and rank 1, the lowest present, does it instead
    result = cli("ps", *ARGS, "--max-restarts", "0", "--reassign-after", "1", "--aggregation-mode", mode,
                 "--inject", f"kill:worker={killed}:step=4",
                 "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    # from the shards' ledgers: no block missing on either shard, and nothing applied twice
    assert summary["samples_lost"] == 0
    assert summary["samples_applied"] == EPOCHS * TRAIN
    assert summary["reassigned_workers"] == [killed]
    # its whole second epoch at least, and what was left of its first
    assert EPOCHS * BATCHES * BATCH - 4 * BATCH >= summary["samples_taken_over"] >= BATCHES * BATCH
    (failure,) = summary["failures"]
    assert failure["process"] == f"worker{killed}" and "SIGKILL" in failure["reason"]
    assert "restart_s" not in failure
    nodes = {node["node_id"]: node for node in read_status(tmp_path / "logs" / "cluster.db").nodes}
    assert nodes[f"worker{killed}"]["state"] == "reassigned" and nodes[f"worker{killed}"]["restarts"] == 0
    assert all(nodes[f"worker{r}"]["state"] == "done" for r in range(WORKERS) if r != killed)
    # the survivors evaluated the model between them, and it learnt
    assert summary["final_accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reassigned_worker_that_rejoins_takes_back_what_is_left_and_nothing_is_applied_twice(tmp_path, cli):
    # Restarted once, after it was reassigned: its processes start as new interpreters, and
    # a start takes longer than the half second it may stay away (forked from the fork
    # server, it is back within 0.3 s); the survivors are slowed (a few seconds an epoch) so
    # it is back while they still train.
    epochs = 6
    result = cli("ps", *ARGS, "--num-epochs", str(epochs), "--max-restarts", "1", "--reassign-after", "0.5",
                 "--inject", "kill:worker=2:step=2", "--inject", "slow:worker=0:factor=60",
                 "--inject", "slow:worker=1:factor=60", "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=240, env={FORK_SERVER_ENV: "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == epochs * TRAIN
    snapshot = read_status(tmp_path / "logs" / "cluster.db", max_events=1000)
    events = [e["kind"] for e in snapshot.events if e["node_id"] == "worker2"]
    assert events.index("reassigned") < events.index("restarted"), events
    nodes = {node["node_id"]: node for node in snapshot.nodes}
    assert nodes["worker2"]["state"] == "done" and nodes["worker2"]["restarts"] == 1
    # back before the end, it did its own blocks from then on: the others took over some
    # of them at most, not all it had left
    assert summary["reassigned_workers"] == []
    assert summary["samples_taken_over"] < epochs * BATCHES * BATCH - 2 * BATCH
