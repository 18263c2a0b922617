"""`disttrain coordinator` and `disttrain status` as real processes: a coordinator killed
with SIGKILL and started again on its registry shows the same cluster (nodes, their
latest loss, recoveries, events); failures and the injected kill are announced; corrupt
registries and unreachable coordinators give clear errors and leave files as they were."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from disttrain.coordinator.client import CoordinatorClient
from disttrain.coordinator.membership import Membership
from disttrain.coordinator.registry import Registry
from disttrain.coordinator.reports import NodeMetrics, NodeProcess
from disttrain.core.processes import EVENT_PREFIX, PARENT_ENV
from disttrain.proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(120)

FAST = ["--set", "coordinator.heartbeat_interval=0.1", "--set", "coordinator.heartbeat_timeout=0.5"]


class Coordinator:
    """`disttrain coordinator` in a child process; its event lines in a queue."""

    def __init__(self, registry: Path, log: Path, *extra: str):
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        with log.open("ab") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "disttrain", "coordinator", "--bind", "127.0.0.1:0",
                 "--registry", str(registry), *extra], stdout=subprocess.PIPE, stderr=stderr,
                stdin=subprocess.DEVNULL, env=env, text=True)
        self.log = log
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self.next_event("listening")["address"]

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(EVENT_PREFIX):
                self.events.put(json.loads(line[len(EVENT_PREFIX):]))

    def next_event(self, kind: str, timeout_s: float = 30.0) -> dict:
        while True:
            try:
                event = self.events.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"no {kind} event; log:\n{self.log.read_text()[-2000:]}") from None
            if event["event"] == kind:
                return event

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def started(tmp_path):
    coordinators: list[Coordinator] = []

    def start(registry: Path, *extra: str) -> Coordinator:
        coordinators.append(Coordinator(registry, tmp_path / f"coordinator{len(coordinators)}.log", *extra))
        return coordinators[-1]

    yield start
    for coordinator in coordinators:
        coordinator.stop()


def status_json(cli, *source: str) -> dict:
    result = cli("status", *source, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow  # a coordinator started twice: make test runs it, make test-fast does not
def test_a_coordinator_killed_and_restarted_on_its_registry_shows_the_same_cluster(tmp_path, started, cli):
    registry = tmp_path / "cluster.db"
    first = started(registry)
    client = CoordinatorClient(first.address)
    client.register("server-0", "server", rank=0, address="127.0.0.1:50051")
    client.register("worker-0", "worker", rank=0)
    client.heartbeat(pb.HeartbeatMessage(node_id="worker-0", step=25, role="worker", pid=os.getpid()))
    client.report_exit("worker-0", 137, "killed by SIGKILL")
    client.register("worker-0", "worker", rank=0)  # its restart
    client.report_metrics("worker-0", NodeMetrics(25, 0, {"loss/train": 0.4321, "accuracy/test": 0.875}))
    for batch_size, plans in ((24, 1), (40, 2)):  # its balance plan, then a re-plan (written at once)
        client.heartbeat(pb.HeartbeatMessage(node_id="worker-0", step=25, role="worker", pid=os.getpid(),
                                             batch_size=batch_size, warmup_speed=900.0, plans=plans))
    client.close()
    first.kill()

    # The nodes above heartbeat no more: a long timeout keeps the restarted coordinator from
    # declaring them failed while the three `status` processes start (seconds each on a busy machine).
    second = started(registry, "--set", "coordinator.heartbeat_timeout=120")
    from_coordinator = status_json(cli, "--coordinator", second.address)
    from_registry = status_json(cli, "--registry", str(registry))
    for cluster in (from_coordinator, from_registry):
        nodes = {node["node_id"]: node for node in cluster["nodes"]}
        assert cluster["generation"] == 4 and set(nodes) == {"server-0", "worker-0"}
        assert nodes["worker-0"]["restarts"] == 1 and nodes["worker-0"]["step"] == 25
        assert nodes["server-0"]["address"] == "127.0.0.1:50051"
        assert nodes["server-0"]["capabilities"]["cpus"] > 0
        assert "gpu_count" in nodes["server-0"]["capabilities"]
        worker = nodes["worker-0"]
        assert (worker["batch_size"], worker["warmup_speed"], worker["plans"]) == (40, 900.0, 2)
        assert [e["kind"] for e in cluster["events"]] == ["joined", "joined", "failed", "restarted",
                                                          "recovered", "rebalanced"]
        assert worker["metrics"] == {"loss/train": 0.4321, "accuracy/test": 0.875}
        assert worker["metrics_step"] == 25
        assert nodes["server-0"]["metrics"] == {}
        (recovery,) = cluster["recoveries"]
        assert (recovery["node_id"], recovery["reason"], recovery["detect_s"], recovery["generation"]) == (
            "worker-0", "killed by SIGKILL", 0.0, 4)
        assert recovery["recover_s"] > 0 and recovery["time"] > 0

    table = cli("status", "--coordinator", second.address, timeout=60)
    assert table.returncode == 0 and "worker-0" in table.stdout and "generation 4" in table.stdout
    assert "BATCH" in table.stdout and "WARM-UP/S" in table.stdout, table.stdout
    lines = table.stdout.splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    loss_at = header.index("LOSS")
    row = next(line for line in lines if line.startswith("worker-0"))
    assert "40 (plan 2)" in row and row.endswith("900.0"), row
    assert row[loss_at:].split()[0] == "0.4321", table.stdout  # its latest training loss
    server_row = next(line for line in lines if line.startswith("server-0"))
    assert server_row[loss_at:].split()[0] == "-", table.stdout  # a server reports none
    recoveries = lines.index(next(line for line in lines if line.startswith("recoveries")))
    assert lines[recoveries + 1].split() == ["TIME", "NODE", "DETECTED", "IN", "BACK", "IN", "REASON"]
    assert lines[recoveries + 2].split()[1:3] == ["worker-0", "0.00s"], table.stdout
    assert lines[recoveries + 2].endswith("killed by SIGKILL"), table.stdout
    assert "worker-0  rebalanced: batch 24 -> 40 (plan 2)" in table.stdout, table.stdout


@pytest.mark.slow  # a coordinator as a process
def test_failures_by_timeout_are_announced_and_the_injected_kill_fires(tmp_path, started):
    coordinator = started(tmp_path / "cluster.db", *FAST, "--inject", "kill:coordinator:step=10")
    client = CoordinatorClient(coordinator.address)
    client.register("worker-1", "worker", rank=1)  # and never a heartbeat
    failed = coordinator.next_event("node-failed", timeout_s=10.0)
    assert failed["node"] == "worker-1" and "no heartbeat" in failed["reason"]

    client.register("worker-0", "worker", rank=0)
    client.heartbeat(pb.HeartbeatMessage(node_id="worker-0", step=9, role="worker", pid=os.getpid()))
    assert coordinator.process.poll() is None
    with pytest.raises(Exception):  # noqa: B017 - the coordinator dies while answering
        client.heartbeat(pb.HeartbeatMessage(node_id="worker-0", step=10, role="worker", pid=os.getpid()))
    assert coordinator.process.wait(timeout=10) == -signal.SIGKILL
    client.close()


@pytest.mark.slow  # a process of the command line
def test_a_corrupt_registry_is_refused_and_left_as_it_was(tmp_path, cli):
    registry = tmp_path / "cluster.db"
    content = b"not a database " * 200
    registry.write_bytes(content)
    for args in (["coordinator", "--bind", "127.0.0.1:0", "--registry", registry],
                 ["status", "--registry", registry]):
        result = cli(*args, timeout=60, env={PARENT_ENV: str(os.getpid())})
        assert result.returncode == 1
        assert "is not a disttrain cluster registry" in result.stderr and "Traceback" not in result.stderr
    assert registry.read_bytes() == content


@pytest.mark.slow  # a process of the command line
def test_status_of_a_registry_escapes_what_a_terminal_would_act_on(tmp_path, cli):
    registry = tmp_path / "cluster.db"
    membership = Membership(heartbeat_timeout_s=5.0)  # written past the coordinator's bounds
    membership.register("evil\x1b[2J", "worker", now=0.0, process=NodeProcess(1, hostname="host\rX"))
    membership.exited("evil\x1b[2J", 1, "killed\x1b]0;owned\x07 \u202eoverride", now=1.0)
    with_events = Registry(registry)
    with_events.save(membership.to_rows(), [vars(e) for e in membership.take_events()], membership.generation)
    with_events.close()
    result = cli("status", "--registry", registry, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not {"\x1b", "\r", "\x07", "\u202e"} & set(result.stdout)
    assert "evil\\x1b[2J" in result.stdout and "killed\\x1b]0;owned\\x07 \\u202eoverride" in result.stdout


@pytest.mark.slow  # a process of the command line
def test_status_refuses_in_one_line_a_registry_an_earlier_disttrain_wrote_with_nan(tmp_path, cli):
    registry = tmp_path / "cluster.db"
    membership = Membership(heartbeat_timeout_s=5.0)
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    membership.get("worker-0").throughput = math.nan  # SQLite stores a NaN as NULL
    written = Registry(registry)
    written.save(membership.to_rows(), [], membership.generation)
    written.close()
    result = cli("status", "--registry", registry, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "was written by an earlier disttrain (node worker-0 has no throughput" in result.stderr
    assert "pass the --registry of a run of this one" in result.stderr


@pytest.mark.slow  # a process of the command line
def test_status_errors_say_what_is_wrong(tmp_path, cli):
    missing = cli("status", "--registry", tmp_path / "missing.db", timeout=60)
    assert missing.returncode == 1 and "no cluster registry at" in missing.stderr
    unreachable = cli("status", "--coordinator", "127.0.0.1:1", timeout=60)
    assert unreachable.returncode == 1 and "cannot reach the coordinator at 127.0.0.1:1" in unreachable.stderr
    bad = cli("status", "--coordinator", "nowhere", timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


@pytest.mark.slow  # a process of the command line
def test_status_watch_redraws_until_ctrl_c(tmp_path):
    registry = tmp_path / "cluster.db"
    Registry(registry).close()
    process = subprocess.Popen([sys.executable, "-m", "disttrain", "status", "--registry", str(registry),
                                "--watch", "0.1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    frames = [json.loads(process.stdout.readline()) for _ in range(2)]
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert all(frame["generation"] == 0 and frame["nodes"] == [] for frame in frames)
