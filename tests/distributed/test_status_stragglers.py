"""`disttrain status` marks the straggler: a real coordinator on port 0, three workers
heartbeating through the real client, one of them ten times slower per step; once the
coordinator has flagged it (after a heartbeat timeout of sustained slowness, on its own
clock), `disttrain status` run as a process marks it, and only it, from the coordinator
and from the registry file, as a table and as JSON."""

from __future__ import annotations

import json

import pytest

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.background import HeartbeatSender
from disttrain.coordinator.client import CoordinatorClient
from disttrain.coordinator.reports import NodeIdentity, NodeProgress, NodeReports
from disttrain.coordinator.service import CoordinatorServer

# Speeds measured in the run decide what it does: no other test may share the cores (make test
# runs the `serial` tests after the others, one at a time).
pytestmark = [pytest.mark.timeout(60), pytest.mark.serial]

CONFIG = CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0, straggler_factor=2.0)
STEP_TIME_S = {"worker-0": 0.01, "worker-1": 0.01, "worker-2": 0.1}
STRAGGLER = "worker-2"


class Worker:
    """A node that reports one more step at each heartbeat, taking `step_time_s` of work."""

    def __init__(self, address: str, node_id: str, rank: int, step_time_s: float):
        self.step, self.step_time_s = 0, step_time_s
        self.client = CoordinatorClient(address)
        self.client.register(node_id, "worker", rank=rank)
        self.sender = HeartbeatSender(self.client, NodeIdentity(node_id, "worker", rank),
                                      CONFIG.heartbeat_interval, NodeReports(self.progress),
                                      on_declared_dead=lambda: None)

    def progress(self) -> NodeProgress:
        self.step += 1
        return NodeProgress(0, self.step, 32 * self.step, work_s=self.step * self.step_time_s)

    def stop(self) -> None:
        self.sender.stop()
        self.client.close()


@pytest.fixture
def cluster(tmp_path):
    """(coordinator address, registry path) once the coordinator has flagged the straggler;
    the workers heartbeat until the test ends (a silent node would be declared failed)."""
    registry = tmp_path / "registry.db"
    server = CoordinatorServer(CONFIG, "127.0.0.1:0", registry)
    workers = [Worker(server.address, node_id, rank, step_time_s)
               for rank, (node_id, step_time_s) in enumerate(STEP_TIME_S.items())]
    try:
        for worker in workers:
            worker.sender.start()
        with server.state.changed:  # notified on every event the monitor finds
            flagged = server.state.changed.wait_for(
                lambda: server.state.membership.get(STRAGGLER).straggler, timeout=20.0)
        assert flagged, [vars(node) for node in server.state.membership.members()]
        yield server.address, registry
    finally:
        for worker in workers:
            worker.stop()
        server.stop(0)


def status(cli, *source: str) -> tuple[str, dict]:
    table, as_json = cli("status", *source, timeout=60), cli("status", *source, "--json", timeout=60)
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    return table.stdout, json.loads(as_json.stdout)


def assert_straggler_marked(table: str, cluster: dict) -> None:
    assert cluster["stragglers"] == [STRAGGLER]
    assert {node["node_id"]: node["straggler"] for node in cluster["nodes"]} == {
        node_id: node_id == STRAGGLER for node_id in STEP_TIME_S}
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("worker-")}
    assert set(rows) == {"worker-0", "worker-1", f"{STRAGGLER}*"}, table
    assert f"* straggler: {STRAGGLER} (0.100s/step)" in table.splitlines(), table
    assert f"{STRAGGLER}  straggler: step time 0.100s" in table, table  # the event


@pytest.mark.slow  # processes of the command line
def test_status_marks_the_straggler_from_the_coordinator_and_from_its_registry(cluster, cli):
    address, registry = cluster
    assert_straggler_marked(*status(cli, "--coordinator", address))
    assert_straggler_marked(*status(cli, "--registry", str(registry)))
