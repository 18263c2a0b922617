"""Every RPC of a live shard server under random and mutated messages: the server never
crashes, answers each refusal with a status code, changes nothing on a refused message,
and still answers GetStatus afterwards."""

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ps_server import frames, make_config

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient
from disttrain.strategies.ps.worker.shard_client import RetryPolicy
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(300)

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CALL_TIMEOUT_S = 0.2  # long-polls and barriers given random content end at this deadline
WORKER = "worker-registered-7f3a"
UNARY = [name for name, (kind, _, _) in wire.METHODS.items() if kind == "unary_unary" and name != "Shutdown"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("fuzz"))
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0")
    plan = plan_shards(init_model(config.training), 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=5.0, max_attempts=1))
    client.register(WORKER)
    channel = grpc.insecure_channel(server.address, options=wire.CHANNEL_OPTIONS)
    yield server, plan, channel
    channel.close()
    client.close()
    server.stop(0)


def snapshot(server):
    return server.state.version, server.state.parameters().clone()


def still_serving(channel):
    status = channel.unary_unary(wire.method_path("GetStatus"), request_serializer=wire.identity,
                                 response_deserializer=pb.ShardStatus.FromString)(b"", timeout=5.0)
    assert status.world_size >= 1


def call(channel, name: str, payload):
    kind = wire.METHODS[name][0]
    method = getattr(channel, kind)(wire.method_path(name), request_serializer=wire.identity,
                                    response_deserializer=wire.identity)
    result = method(payload, timeout=CALL_TIMEOUT_S)
    return list(result) if kind == "unary_stream" else result


def refused_or_harmless(server, channel, name: str, payload) -> None:
    version, parameters = snapshot(server)
    try:
        call(channel, name, payload)
    except grpc.RpcError as e:
        assert isinstance(e.code(), grpc.StatusCode) and e.code() != grpc.StatusCode.OK
        assert server.state.version == version and torch.equal(server.state.parameters(), parameters)
    still_serving(channel)


@FAST
@given(st.sampled_from([*UNARY, "GetParameters"]), st.binary(max_size=300))
def test_random_bytes_to_every_call(live, name, raw):
    server, _, channel = live
    refused_or_harmless(server, channel, name, raw)


@FAST
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_random_push_streams(live, chunks):
    server, _, channel = live
    refused_or_harmless(server, channel, "SendGradients", iter(chunks))


@FAST
@given(st.integers(min_value=0), st.integers(0, 255), st.sampled_from(["flip", "truncate"]),
       st.sampled_from([WORKER, "stranger"]), st.integers(min_value=1, max_value=2**40))
def test_mutated_pushes_apply_whole_or_leave_no_trace(live, position, value, how, worker, step):
    server, plan, channel = live
    raws = list(frames(plan, torch.full((plan.numel,), 1e-3), worker_id=worker, step=step))
    first = bytearray(raws[0])
    if how == "flip":
        first[position % len(first)] = value
    else:
        first = first[:position % len(first)]
    version, parameters = snapshot(server)
    try:
        call(channel, "SendGradients", iter([bytes(first), *raws[1:]]))
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.OK
        assert server.state.version == version and torch.equal(server.state.parameters(), parameters)
    if worker != WORKER:  # a stranger's push never changes anything, mangled or not
        assert server.state.version == version
    assert torch.isfinite(server.state.parameters()).all()
    still_serving(channel)


@pytest.mark.slow
@settings(FAST, max_examples=1500)
@given(st.sampled_from([*UNARY, "GetParameters", "SendGradients"]), st.binary(max_size=400))
def test_thousands_of_random_calls(live, name, raw):
    server, _, channel = live
    refused_or_harmless(server, channel, name, iter([raw]) if name == "SendGradients" else raw)
