"""Every RPC of a live coordinator under random bytes: it never crashes, answers each
refusal with a status code, keeps the nodes it knows as they were, and still answers."""

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain.config import CoordinatorConfig
from disttrain.coordinator.client import METHODS, CoordinatorClient, method_path
from disttrain.coordinator.service import CoordinatorServer
from disttrain.proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(300)

NODE = "worker-known-41c9"
CASES = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # A long timeout: the known node must not be declared failed while the fuzzing runs.
    config = CoordinatorConfig(heartbeat_interval=1.0, heartbeat_timeout=600.0)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path_factory.mktemp("fuzz") / "registry.db")
    client = CoordinatorClient(server.address, timeout_s=5.0)
    client.register(NODE, "worker", rank=0)
    channel = grpc.insecure_channel(server.address)
    yield client, channel
    channel.close()
    client.close()
    server.stop(0)


def known(client: CoordinatorClient):
    member = next(m for m in client.status().nodes if m.node_id == NODE)
    return member.state, member.restarts, member.rank, member.pid


def check(live, name: str, raw: bytes) -> None:
    client, channel = live
    before = known(client)
    method = channel.unary_unary(method_path(name), request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    try:
        method(raw, timeout=0.2)  # a membership long-poll ends at this deadline
    except grpc.RpcError as e:
        assert isinstance(e.code(), grpc.StatusCode) and e.code() != grpc.StatusCode.OK
    assert known(client) == before


@CASES
@given(st.sampled_from(list(METHODS)), st.binary(max_size=300))
def test_random_bytes_to_every_call(live, name, raw):
    check(live, name, raw)


@pytest.mark.slow
@settings(CASES, max_examples=1500)
@given(st.sampled_from(list(METHODS)), st.binary(max_size=600))
def test_thousands_of_random_calls(live, name, raw):
    check(live, name, raw)


def unknown_fields(count: int) -> bytes:
    """`count` fields of a number no message has (field 999, varint 1): parsed and kept as unknown."""
    return b"\xb8\x3e\x01" * count


LARGE = {
    "RegisterNode": pb.RegisterNodeRequest(node_id="n" * 3_000_000, role="worker", pid=1).SerializeToString(),
    "SendHeartbeat": pb.HeartbeatMessage(node_id=NODE, role="r" * 3_000_000, pid=1).SerializeToString(),
    "ReportMetrics": pb.MetricsReport(node_id=NODE, scalars={f"k{i}": 1.0 for i in range(50_000)})
    .SerializeToString(),
    "ReportExit": pb.ExitReport(node_id=NODE, exit_code=1, reason="x" * 3_000_000, pid=1, generation=1)
    .SerializeToString(),
    "WatchMembership": unknown_fields(1_000_000),
    "GetClusterStatus": unknown_fields(1_000_000),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_megabytes_and_thousands_of_fields_to_every_call(live, name):
    check(live, name, LARGE[name])
