"""A shard server and a coordinator started with TLS, on real sockets (port 0), with
certificates made for the test: clients holding the run's CA (and token) work; a client
trusting another CA, or one without TLS, gets nothing through and changes nothing; with
mutual TLS, a client without a certificate is refused."""

from __future__ import annotations

import logging
import os

import grpc
import pytest
import torch
from tls_certs import issue, make_authority

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.service import SERVICE as COORDINATOR_SERVICE
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core.channels import open_channel
from disttrain.core.credentials import Credentials
from disttrain.core.errors import DistributedError
from disttrain.core.rpc_server import RpcServer, ServerLimits
from disttrain.core.tls import TlsFiles
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config
from tests.distributed.test_rpc_auth import call

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token-of-this-run"
QUICK = RetryPolicy(timeout_s=3.0, max_attempts=1)


@pytest.fixture
def pki(tmp_path):
    ca, other = make_authority(tmp_path, "ca"), make_authority(tmp_path, "other-ca")
    server_cert, server_key = issue(ca, tmp_path, "server")
    client_cert, client_key = issue(ca, tmp_path, "client")
    stranger_cert, stranger_key = issue(other, tmp_path, "stranger")
    return {
        "server": TlsFiles(str(server_cert), str(server_key)),
        # the client's certificate names no role of a run: the operator names it as its own
        "mutual_server": TlsFiles(str(server_cert), str(server_key), str(ca.pem_path), operators=("client",)),
        "client": TlsFiles(str(client_cert), str(client_key), str(ca.pem_path)),
        "ca_only": TlsFiles(ca=str(ca.pem_path)),
        "stranger": TlsFiles(str(stranger_cert), str(stranger_key), str(other.pem_path)),
    }


def start_shard(tmp_path, tls: TlsFiles):
    config = make_config(tmp_path)
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", credentials=Credentials(TOKEN, tls))
    plan = plan_shards(init_model(config.training), 1)[0]
    return server, plan


def ps_client(server, plan, tls: TlsFiles, policy: RetryPolicy = QUICK) -> PSClient:
    return PSClient([server.address], [plan], policy, transport="grpc", credentials=Credentials(TOKEN, tls))


def test_a_client_with_the_ca_and_token_registers_pushes_and_pulls(tmp_path, pki):
    server, plan = start_shard(tmp_path, pki["server"])
    client = ps_client(server, plan, pki["ca_only"], RetryPolicy(timeout_s=10.0, max_attempts=2))
    try:
        assert client.register("w0").world_size == 1
        before = server.state.parameters().clone()
        header = pb.GradientMessage(worker_id="w0", step=1, base_version=0, shard=0, num_samples=8,
                                    block_id=1)
        (reply,) = client.push([header], torch.ones(plan.numel), [0])
        assert reply.outcome == pb.PushReply.APPLIED and server.state.version == 1
        flat = torch.empty(plan.numel)
        assert client.pull("w0", flat, [1]) == [1]
        assert torch.equal(flat, server.state.parameters()) and not torch.equal(flat, before)
    finally:
        client.close()
        server.stop(0)


def test_a_client_trusting_another_ca_gets_nothing_through(tmp_path, pki):
    server, plan = start_shard(tmp_path, pki["server"])
    before = server.state.parameters().clone()
    channel = open_channel(server.address, pki["stranger"], TOKEN)
    stranger = ps_client(server, plan, pki["stranger"])
    try:
        with pytest.raises(grpc.RpcError) as raised:
            call(channel, "Shutdown", pb.ShutdownRequest())
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(DistributedError):
            stranger.register("w0")
    finally:
        channel.close()
        stranger.close()
    assert not server.stopped.is_set()
    assert server.state.version == 0 and torch.equal(server.state.parameters(), before)
    server.stop(0)


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, pki):
    server, plan = start_shard(tmp_path, pki["mutual_server"])
    anonymous = open_channel(server.address, pki["ca_only"], TOKEN)
    member = ps_client(server, plan, pki["client"], RetryPolicy(timeout_s=10.0, max_attempts=2))
    try:
        with pytest.raises(grpc.RpcError) as raised:
            call(anonymous, "Shutdown", pb.ShutdownRequest())
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not server.stopped.is_set()
        assert member.register("w0").world_size == 1  # the client with a certificate of the CA gets in
    finally:
        anonymous.close()
        member.close()
        server.stop(0)


def test_the_coordinator_with_tls_serves_clients_with_the_ca_only(tmp_path, pki):
    server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "registry.db",
                               credentials=Credentials(TOKEN, pki["mutual_server"]))
    plain = CoordinatorClient(server.address, timeout_s=3.0, token=TOKEN)
    member = CoordinatorClient(server.address, timeout_s=10.0, token=TOKEN, tls=pki["client"])
    try:
        with pytest.raises(CoordinatorError) as raised:
            plain.register("worker0", "worker", retry_s=0)
        assert raised.value.unreachable
        assert member.register("worker0", "worker").generation >= 1
        member.heartbeat(cpb.HeartbeatMessage(node_id="worker0", step=3, pid=os.getpid()))
        (node,) = member.status().nodes
        assert node.node_id == "worker0" and node.step == 3
    finally:
        plain.close()
        member.close()
        server.stop(0)


def warnings_of(caplog, bind: str, **kwargs) -> list[str]:
    handler = grpc.method_handlers_generic_handler(COORDINATOR_SERVICE, {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="disttrain.core.rpc_server"):
        RpcServer(handler, COORDINATOR_SERVICE, bind, ServerLimits(2), Credentials(**kwargs)).stop(0)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_warning_beyond_loopback_knows_about_tls(caplog, pki):
    assert warnings_of(caplog, "0.0.0.0:0", tls=pki["mutual_server"]) == []
    assert "TLS on for" in caplog.text and "mutual" in caplog.text
    (warning,) = warnings_of(caplog, "0.0.0.0:0", tls=pki["server"])
    assert "with TLS but without a token or client certificates" in warning
    assert "any client that reaches this port can still call it" in warning
    assert warnings_of(caplog, "0.0.0.0:0", tls=pki["server"], token=TOKEN) == []
    assert warnings_of(caplog, "127.0.0.1:0", tls=pki["server"]) == []
