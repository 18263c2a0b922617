"""A worker restarted after the run ended (found by disttrain chaos, ps-reassign seed 8:
worker 1 was killed at step 90 and taken over by worker 0; it came back 6 s later, after
worker 0 had finished and stopped the shards, and then waited for a shard to register it
until the launcher stopped it a minute later). The coordinator tells a node joining a
run whose shards are all done, and such a worker ends at once, without a shard."""

from __future__ import annotations

import time

import pytest

from disttrain.chaos.invariants import reassigned_workers
from disttrain.config import config_from_dict
from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import CoordinatorClient
from disttrain.coordinator.service import CoordinatorServer
from disttrain.strategies.ps.run.worker import run_worker
from disttrain.training.options import RunOptions

pytestmark = pytest.mark.timeout(60)

CONFIG = CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=5.0, reassign_after=0.2)


@pytest.fixture
def coordinator(tmp_path):
    server = CoordinatorServer(CONFIG, "127.0.0.1:0", tmp_path / "cluster.db")
    client = CoordinatorClient(server.address, timeout_s=5.0)
    yield server, client
    client.close()
    server.stop(0)


def test_a_node_joining_is_told_the_run_finished_once_every_shard_is_done(coordinator):
    _, client = coordinator
    assert not client.register("worker0", "worker", rank=0).run_finished  # no shard yet
    for shard in range(2):
        client.register(f"server{shard}", "server", rank=shard, address=f"127.0.0.1:{5000 + shard}")
    client.report_exit("server0", 0, "finished")
    assert not client.register("worker1", "worker", rank=1).run_finished  # shard 1 still serves
    client.report_exit("server1", 0, "finished")
    client.report_exit("worker1", -9, "killed by SIGKILL")
    assert client.register("worker1", "worker", rank=1).run_finished


def test_a_worker_restarted_after_the_run_ended_stops_at_once_and_says_so(coordinator, tmp_path, caplog):
    server, client = coordinator
    client.register("server0", "server", rank=0, address="127.0.0.1:5000")
    client.report_exit("server0", 0, "finished")
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp"},
        "system": {"num_workers": 2, "checkpoint_dir": str(tmp_path / "ckpt")},
        "coordinator": {"address": server.address, "heartbeat_interval": 0.1, "heartbeat_timeout": 5.0},
        "ps": {"rpc_timeout_s": 60.0}})
    started = time.monotonic()
    # The shard's address is closed: a worker that tried it would wait out its 60 s retries.
    with caplog.at_level("INFO"):
        assert run_worker(config, ["127.0.0.1:1"], "worker1", 1, RunOptions()) is None
    assert time.monotonic() - started < 30
    assert "the run finished while worker1 was away" in caplog.text
    (member,) = [m for m in client.watch_membership(-1, 1.0).members if m.node_id == "worker1"]
    assert member.state == "done"


def test_the_chaos_checks_read_which_workers_were_taken_over_from_the_registry(coordinator, tmp_path):
    _, client = coordinator
    for rank in range(3):
        client.register(f"worker{rank}", "worker", rank=rank)
    client.report_exit("worker2", -9, "killed by SIGKILL")
    deadline, generation = time.monotonic() + 10, -1
    while time.monotonic() < deadline:  # the coordinator reassigns it reassign_after seconds on
        membership = client.watch_membership(generation, deadline - time.monotonic())
        generation = membership.generation
        if any(m.node_id == "worker2" and m.state == "reassigned" for m in membership.members):
            break
    client.register("worker2", "worker", rank=2)  # back: no longer away, but it was taken over
    assert reassigned_workers(tmp_path) == {2}
