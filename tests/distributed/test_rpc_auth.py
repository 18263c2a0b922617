"""A shard server and a coordinator started with a token, on real sockets (port 0): every
call without it, or with a wrong one, is refused UNAUTHENTICATED and changes nothing; the
right token works; health checks answer without one."""

from __future__ import annotations

import logging
import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.service import SERVICE as COORDINATOR_SERVICE
from disttrain.coordinator.service import CoordinatorServer
from disttrain.core.auth import REFUSED, with_token
from disttrain.core.credentials import Credentials
from disttrain.core.rpc_server import RpcServer, ServerLimits
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import frames, make_config

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token-of-this-run"
NO_TOKEN, WRONG_TOKEN = None, "not-the-token"


@pytest.fixture
def shard(tmp_path):
    config = make_config(tmp_path)
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", credentials=Credentials(TOKEN))
    plan = plan_shards(init_model(config.training), 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=2),
                      credentials=Credentials(TOKEN))
    client.register("w0")
    yield server, client, plan
    client.close()
    server.stop(0)


def shard_calls(plan) -> dict:
    """One call of each kind that would change or reveal the shard, by name."""
    pull = pb.ParameterRequest(worker_id="w0", min_version=0, shard=0)
    return {
        "SendGradients": lambda: frames(plan, torch.ones(plan.numel)),
        "PushGradients": lambda: b"".join(frames(plan, torch.ones(plan.numel))),
        "GetParameters": lambda: pull,
        "FetchParameters": lambda: pull,
        "WorkerDone": lambda: pb.WorkerDoneRequest(worker_id="w0"),
        "Shutdown": lambda: pb.ShutdownRequest(),
        "GetStatus": lambda: pb.StatusRequest(),
    }


def call(channel: grpc.Channel, name: str, request):
    kind, request_type, response_type = wire.METHODS[name]
    serialize = wire.identity if request_type is None else request_type.SerializeToString
    method = getattr(channel, kind)(wire.method_path(name), request_serializer=serialize,
                                    response_deserializer=wire.identity)
    reply = method(request, timeout=10)
    return list(reply) if kind == "unary_stream" else reply


@pytest.mark.parametrize("token", [NO_TOKEN, WRONG_TOKEN], ids=["no token", "wrong token"])
def test_shard_refuses_every_call_without_the_token_and_changes_nothing(shard, token):
    server, client, plan = shard
    before = server.state.parameters().clone()
    channel = with_token(grpc.insecure_channel(server.address), token)
    try:
        for name, request in shard_calls(plan).items():
            with pytest.raises(grpc.RpcError) as raised:
                call(channel, name, request())
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "DISTTRAIN_TOKEN" in raised.value.details() and "--token-file" in raised.value.details()
    finally:
        channel.close()
    assert not server.stopped.is_set()  # Shutdown did not run
    (status,) = client.call_all("GetStatus", pb.StatusRequest())  # an authorized client sees it as it was
    assert status.version == 0 and status.num_done == 0 and status.num_applied == 0
    flat = torch.empty(plan.numel)
    client.pull("w0", flat, [0])
    assert torch.equal(flat, before)


def test_shard_serves_the_right_token(shard):
    server, client, plan = shard
    channel = with_token(grpc.insecure_channel(server.address), TOKEN)
    try:
        session = client.shards[0].session  # the worker's own, from its registration
        pushed = call(channel, "SendGradients", frames(plan, torch.ones(plan.numel), session=session))
        assert pb.PushReply.FromString(pushed).outcome == pb.PushReply.APPLIED and server.state.version == 1
        assert call(channel, "WorkerDone", pb.WorkerDoneRequest(worker_id="w0", session=session))
        call(channel, "Shutdown", pb.ShutdownRequest(worker_id="w0", session=session))
        assert server.stopped.is_set()
    finally:
        channel.close()


def check_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=10).status


def test_health_answers_without_a_token(shard, tmp_path):
    server, _, _ = shard
    assert check_health(server.address) == health_pb2.HealthCheckResponse.SERVING
    coordinator = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "registry.db",
                                    credentials=Credentials(TOKEN))
    try:
        assert check_health(coordinator.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        coordinator.stop(0)


@pytest.mark.parametrize("token", [NO_TOKEN, WRONG_TOKEN], ids=["no token", "wrong token"])
def test_coordinator_refuses_register_and_heartbeat_without_the_token(tmp_path, token):
    server = CoordinatorServer(CoordinatorConfig(), "127.0.0.1:0", tmp_path / "registry.db",
                               credentials=Credentials(TOKEN))
    intruder = CoordinatorClient(server.address, timeout_s=5.0, token=token)
    member = CoordinatorClient(server.address, timeout_s=5.0, token=TOKEN)
    try:
        for attempt in (lambda: intruder.register("worker0", "worker", retry_s=0),
                        lambda: intruder.heartbeat(cpb.HeartbeatMessage(node_id="worker0", step=3)),
                        intruder.status):
            with pytest.raises(CoordinatorError) as raised:
                attempt()
            assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED and REFUSED in str(raised.value)
        assert list(member.status().nodes) == []  # nothing was registered
        assert member.register("worker0", "worker").generation >= 1
        member.heartbeat(cpb.HeartbeatMessage(node_id="worker0", step=3, pid=os.getpid()))
        assert [node.node_id for node in member.status().nodes] == ["worker0"]
    finally:
        intruder.close()
        member.close()
        server.stop(0)


def test_no_warning_beyond_loopback_with_a_token(caplog):
    handler = grpc.method_handlers_generic_handler(COORDINATOR_SERVICE, {})
    with caplog.at_level(logging.WARNING, logger="disttrain.core.rpc_server"):
        server = RpcServer(handler, COORDINATOR_SERVICE, "0.0.0.0:0", ServerLimits(2), Credentials(TOKEN))
        server.stop(0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
