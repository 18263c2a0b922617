"""Every gRPC server of the project: the standard health service for orchestrators'
probes, a port that cannot be shared by accident, and a warning when it listens beyond
this machine."""

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_ps_server import make_config

from disttrain.config import CoordinatorConfig
from disttrain.coordinator.client import SERVICE as COORDINATOR_SERVICE
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core.errors import ConfigError
from disttrain.core.rpc_server import is_loopback
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING


def health_status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0).status


def test_a_shard_server_answers_health_probes_until_it_stops(tmp_path):
    server = ShardServer(build_state(make_config(tmp_path), 0, 1), "127.0.0.1:0")
    try:
        assert health_status(server.address, "") == SERVING
        assert health_status(server.address, wire.SERVICE) == SERVING
        with pytest.raises(grpc.RpcError) as caught:
            health_status(server.address, "no.such.Service")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(0)
    with pytest.raises(grpc.RpcError) as caught:
        health_status(server.address, "")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_coordinator_answers_health_probes(tmp_path):
    server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "registry.db")
    try:
        assert health_status(server.address, COORDINATOR_SERVICE) == SERVING
    finally:
        server.stop(0)


def test_a_second_server_on_a_taken_port_is_refused_not_bound_beside_it(tmp_path):
    first = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "one.db")
    try:
        with pytest.raises(ConfigError, match=f"--bind {first.address}: cannot listen there"):
            ShardServer(build_state(make_config(tmp_path), 0, 1), first.address)
        assert health_status(first.address, COORDINATOR_SERVICE) == SERVING
    finally:
        first.stop(0)


def test_listening_beyond_this_machine_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="disttrain.core.rpc_server"):
        server = CoordinatorServer(CoordinatorConfig(), "0.0.0.0:0", tmp_path / "registry.db")
        server.stop(0)
        local = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "local.db")
        local.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reachable from other machines" in warnings[0]


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                               ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                               ("192.0.2.7", False), ("node0", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback
