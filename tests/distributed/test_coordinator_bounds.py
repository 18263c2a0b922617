"""A live coordinator (port 0) against a raw gRPC client that sends what no honest node
sends: heartbeats without the node's pid, forged exit reports, oversized and control
character fields, non-finite figures, rank squatting, a flood of new ids and of refused
calls. Each ends with the membership unchanged (or bounded) and the honest node served."""

from __future__ import annotations

import logging
import math
import os

import grpc
import pytest

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import METHODS, CoordinatorClient, method_path
from disttrain.coordinator.registry import read_status
from disttrain.coordinator.service import CoordinatorServer
from disttrain.proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(120)

HONEST = "worker-0"
CLIENT_LIMIT_BYTES = 4 * 1024 * 1024  # gRPC's default receive limit of every client


class Outsider:
    """Raw calls on a channel of its own, answered with their status code."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.calls = {name: self.channel.unary_unary(method_path(name),
                                                     request_serializer=request.SerializeToString,
                                                     response_deserializer=reply.FromString)
                      for name, (request, reply) in METHODS.items()}

    def refused(self, name: str, request) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as caught:
            self.calls[name](request, timeout=5.0)
        return caught.value

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def cluster(tmp_path):
    """A coordinator with the honest worker-0 registered (this process's pid) and an outsider."""
    config = CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path / "registry.db")
    client = CoordinatorClient(server.address, timeout_s=5.0)
    reply = client.register(HONEST, "worker", rank=0)
    outsider = Outsider(server.address)
    yield server, client, outsider, reply.generation
    outsider.close()
    client.close()
    server.stop(0)


def beat(client: CoordinatorClient, step: int = 1, **fields) -> pb.HeartbeatReply:
    return client.heartbeat(pb.HeartbeatMessage(node_id=HONEST, role="worker", step=step,
                                                pid=os.getpid(), **fields))


def membership(client: CoordinatorClient) -> list[tuple]:
    return [(n.node_id, n.state, n.pid, n.rank, n.restarts, n.step, n.throughput, n.joined_generation)
            for n in client.status().nodes]


def test_a_heartbeat_without_the_nodes_pid_keeps_nobody_alive(cluster):
    server, client, outsider, _ = cluster
    before = membership(client)
    refusals = ((0, grpc.StatusCode.INVALID_ARGUMENT), (os.getpid() + 1, grpc.StatusCode.FAILED_PRECONDITION))
    for pid, code in refusals:
        error = outsider.refused("SendHeartbeat", pb.HeartbeatMessage(node_id=HONEST, step=50, pid=pid))
        assert error.code() == code and "pid" in error.details()
    assert membership(client) == before
    (node,) = client.status().nodes
    assert node.heartbeat_age_s == -1.0  # no heartbeat was taken
    # A node heard only through such heartbeats is declared failed once silent past the timeout.
    generation = client.status().generation
    while (changed := client.watch_membership(generation, 5.0)) is not None:
        generation = changed.generation
        if changed.members[0].state == "failed":
            break
    assert [(m.node_id, m.state) for m in changed.members] == [(HONEST, "failed")]


def test_a_forged_exit_report_changes_nothing_and_the_honest_ones_are_taken(cluster):
    _, client, outsider, generation = cluster
    before = membership(client)
    forged = [pb.ExitReport(node_id=HONEST, exit_code=1, reason="forged"),  # names no process
              pb.ExitReport(node_id=HONEST, exit_code=1, pid=os.getpid() + 1, generation=generation),
              pb.ExitReport(node_id=HONEST, exit_code=1, pid=os.getpid(), generation=generation + 7)]
    codes = [outsider.refused("ReportExit", report).code() for report in forged]
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] + [grpc.StatusCode.FAILED_PRECONDITION] * 2
    assert membership(client) == before
    assert beat(client).alive  # the node is served as before
    # Its own process reports with what it registered with; a supervisor without them looks them up.
    assert client.report_exit(HONEST, 0, "finished", os.getpid(), generation).known
    assert membership(client)[0][1] == "done"
    client.register("worker-1", "worker", rank=1)
    assert client.report_exit("worker-1", -9, "killed by SIGKILL").known
    assert [n.state for n in client.status().nodes] == ["done", "failed"]


@pytest.mark.parametrize(("name", "request_", "field"), [
    ("RegisterNode", pb.RegisterNodeRequest(node_id="x" * 1_000_000, role="worker", pid=1), "node_id"),
    ("RegisterNode", pb.RegisterNodeRequest(node_id="evil\x1b[2J", role="worker", pid=1), "node_id"),
    ("RegisterNode", pb.RegisterNodeRequest(node_id="evil", role="worker", pid=1, address="a" * 300_000),
     "address"),
    ("RegisterNode", pb.RegisterNodeRequest(node_id="evil", role="worker", pid=1, hostname="h\n" * 10),
     "hostname"),
    ("RegisterNode", pb.RegisterNodeRequest(node_id="evil", role="worker", pid=1,
                                            capabilities=pb.Capabilities(gpu="g" * 100_000)),
     "capabilities.gpu"),
    ("RegisterNode", pb.RegisterNodeRequest(node_id="evil", role="worker", pid=1, rank=2**31 - 1), "rank"),
    ("ReportExit", pb.ExitReport(node_id=HONEST, reason="r" * 1_000_000, pid=1, generation=1), "reason"),
    ("ReportMetrics", pb.MetricsReport(node_id=HONEST, scalars={"k" * 10_000: 1.0}), "scalars key"),
    ("SendHeartbeat", pb.HeartbeatMessage(node_id=HONEST, pid=os.getpid(), throughput=math.nan),
     "throughput"),
    ("SendHeartbeat", pb.HeartbeatMessage(node_id=HONEST, pid=os.getpid(), step_time_s=math.inf),
     "step_time_s"),
    ("SendHeartbeat", pb.HeartbeatMessage(node_id=HONEST, pid=os.getpid(), warmup_speed=-math.inf),
     "warmup_speed"),
])
def test_a_field_out_of_bounds_is_refused_naming_it_and_changes_nothing(cluster, name, request_, field):
    _, client, outsider, _ = cluster
    beat(client, step=3, throughput=100.0)
    before = membership(client)
    error = outsider.refused(name, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(field) and len(error.details()) < 2000
    assert membership(client) == before
    assert beat(client, step=4, throughput=120.0).alive
    assert client.status().nodes[0].throughput == 120.0


def test_a_nan_throughput_never_reaches_the_registry(cluster):
    server, client, outsider, _ = cluster
    nan = pb.HeartbeatMessage(node_id=HONEST, pid=os.getpid(), throughput=math.nan)
    assert outsider.refused("SendHeartbeat", nan).code() == grpc.StatusCode.INVALID_ARGUMENT
    beat(client, step=2, throughput=64.0)
    server.state.close()  # persists the progress now
    (row,) = read_status(server.registry.path).nodes
    assert row["throughput"] == 64.0


def test_a_rank_held_by_a_live_node_cannot_be_squatted_and_generations_are_the_coordinators(cluster):
    _, client, outsider, generation = cluster
    before = membership(client)
    error = outsider.refused("RegisterNode", pb.RegisterNodeRequest(node_id="squatter", role="worker",
                                                                     rank=0, pid=99))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "worker-0" in error.details()
    # A heartbeat claiming the largest generation moves nothing: generations are issued, not taken.
    assert beat(client, generation=2**63 - 1).generation == generation
    assert membership(client)[0][:5] == before[0][:5]
    assert client.register("worker-1", "worker", rank=1).generation == generation + 1


def test_a_flood_of_new_ids_is_bounded_and_the_live_nodes_stay(tmp_path):
    config = CoordinatorConfig(heartbeat_interval=0.1, heartbeat_timeout=60.0, max_nodes=8)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path / "registry.db")
    client = CoordinatorClient(server.address, timeout_s=5.0)
    outsider = Outsider(server.address)
    try:
        client.register(HONEST, "worker", rank=0)
        codes = []
        for i in range(20):
            node_id, pid = f"flood-{i}", 1000 + i
            try:
                reply = outsider.calls["RegisterNode"](
                    pb.RegisterNodeRequest(node_id=node_id, role="worker", rank=-1, pid=pid), timeout=5.0)
                codes.append(grpc.StatusCode.OK)
                # Each ends (as a supervisor would report): the oldest ended ones make room.
                outsider.calls["ReportExit"](pb.ExitReport(node_id=node_id, exit_code=1, pid=pid,
                                                           generation=reply.generation), timeout=5.0)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert set(codes) == {grpc.StatusCode.OK}  # ended nodes are forgotten, oldest first
        nodes = client.status().nodes
        assert len(nodes) == 8 and HONEST in [n.node_id for n in nodes]
        assert {n.node_id for n in nodes} - {HONEST} == {f"flood-{i}" for i in range(13, 20)}
        assert len(read_status(server.registry.path).nodes) == 8  # forgotten in the registry too
        for i in range(7):  # live ones fill the table: then a new id is refused
            outsider.calls["RegisterNode"](
                pb.RegisterNodeRequest(node_id=f"live-{i}", role="worker", rank=-1, pid=i + 1), timeout=5.0)
        error = outsider.refused("RegisterNode", pb.RegisterNodeRequest(node_id="one-more", role="worker",
                                                                         rank=-1, pid=9))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_nodes" in error.details()
        assert client.heartbeat(pb.HeartbeatMessage(node_id=HONEST, pid=os.getpid(), step=1)).alive
    finally:
        outsider.close()
        client.close()
        server.stop(0)


@pytest.mark.slow  # a table of the largest nodes filled and read: seconds; make test runs it
def test_a_full_table_of_the_largest_nodes_answers_status_and_watches_within_the_client_limit(tmp_path):
    config = CoordinatorConfig(heartbeat_interval=1.0, heartbeat_timeout=600.0)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path / "registry.db")
    client = CoordinatorClient(server.address, timeout_s=30.0)
    try:
        scalars = {f"{i:03d}".ljust(128, "k"): float(i) for i in range(256)}
        for i in range(config.max_nodes):  # straight to the state: the answers are what is tested
            node_id = f"{i:04d}".ljust(128, "n")
            server.state.register(pb.RegisterNodeRequest(
                node_id=node_id, role="worker", rank=-1, pid=i + 1, address="a" * 256, hostname="h" * 256,
                capabilities=pb.Capabilities(cpus=64, memory_bytes=2**40, gpu="g" * 256, gpu_count=8)))
            server.state.report_metrics(pb.MetricsReport(node_id=node_id, step=1, scalars=scalars))
        status = client.status()  # over the client's default 4 MB limit, this call would fail
        assert status.ByteSize() < CLIENT_LIMIT_BYTES // 2
        assert status.omitted_nodes > 0 and len(status.nodes) + status.omitted_nodes == config.max_nodes
        watched = client.watch_membership(-1, 10.0)
        assert len(watched.members) == config.max_nodes and watched.ByteSize() < CLIENT_LIMIT_BYTES // 2
    finally:
        client.close()
        server.stop(0)


def test_refused_calls_log_one_warning_per_caller_per_period(cluster, caplog):
    _, client, outsider, _ = cluster
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            outsider.refused("SendHeartbeat", pb.HeartbeatMessage(node_id="ghost", pid=1))
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1 and "refused SendHeartbeat from ipv4:127.0.0.1 (NOT_FOUND)" in warnings[0]
    assert beat(client).alive
