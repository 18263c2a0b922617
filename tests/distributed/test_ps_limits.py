"""A shard server's resource limits on a real socket (port 0): hostile or broken clients
get a status code, and the server keeps its model, version, optimizer state and ledger
and goes on answering everyone else.
"""

import dataclasses
import itertools
import threading

import grpc
import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.core.poll_slots import PollSlots
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.limits import push_limits
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import frames, make_config

pytestmark = pytest.mark.timeout(60)

WAIT_CAP_S = 4.0  # the server's long-poll cap in these tests


def started(config, **server_options):
    """A shard server of `config` and a client registered as w0 (a fixture's body)."""
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", **server_options)
    plan = plan_shards(init_model(config.training), 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=1))
    client.register("w0")
    yield server, client, plan
    client.close()
    server.stop(0)


@pytest.fixture
def shard(tmp_path):
    yield from started(make_config(tmp_path), max_threads=32, long_poll_cap_s=WAIT_CAP_S)


def call(client, name):
    request_type = wire.METHODS[name][1]
    deserialize = pb.ShardStatus.FromString if name == "GetStatus" else wire.read_parameters
    return client.shards[0].channel.unary_unary(wire.method_path(name),
                                                request_serializer=request_type.SerializeToString,
                                                response_deserializer=deserialize)


def register(client, worker_id):
    """Register `worker_id` through `client`'s channel; its session."""
    call = client.shards[0].channel.unary_unary(wire.method_path("RegisterWorker"),
                                                request_serializer=pb.RegisterRequest.SerializeToString,
                                                response_deserializer=pb.WorkerAssignment.FromString)
    request = pb.RegisterRequest(worker_id=worker_id, requested_rank=-1, key=worker_id.encode() * 16)
    return call(request, timeout=10).session


def snapshot(server):
    state = server.state
    return (state.parameters(), state.version, {k: v.clone() for k, v in state.optimizer.state.get(
        state.param, {}).items()}, state.ledger(0, 0))


def assert_unchanged(server, before):
    params, version, optimizer, ledger = snapshot(server)
    assert torch.equal(params, before[0]) and version == before[1] and ledger == before[3]
    assert optimizer.keys() == before[2].keys()
    assert all(torch.equal(optimizer[k], before[2][k]) for k in optimizer)
    status = call_status(server)
    assert status.version == before[1]


def call_status(server):
    with grpc.insecure_channel(server.address) as channel:
        get = channel.unary_unary(wire.method_path("GetStatus"),
                                  request_serializer=pb.StatusRequest.SerializeToString,
                                  response_deserializer=pb.ShardStatus.FromString)
        return get(pb.StatusRequest(), timeout=2)


@pytest.fixture
def crowded_shard(tmp_path):
    yield from started(make_config(tmp_path, num_workers=16), max_threads=32, long_poll_cap_s=WAIT_CAP_S)


@pytest.mark.slow
def test_pending_long_polls_leave_threads_for_status_calls(crowded_shard):
    server, client, plan = crowded_shard
    num_calls, num_workers = 64, 16
    sessions = [client.shards[0].session] + [register(client, f"w{i}") for i in range(1, num_workers)]
    before = snapshot(server)
    fetch = call(client, "FetchParameters")
    admitted = min(num_workers * server.polls.per_key, server.polls.max_total)
    assert admitted < num_calls and server.polls.max_total < 32  # both caps are exercised
    ended, lock, refused_all = [], threading.Lock(), threading.Event()

    def on_done(future):
        with lock:
            ended.append(future.code())
            if len(ended) == num_calls - admitted:
                refused_all.set()

    futures = []
    for i in range(num_calls):  # no client deadline: the server's cap ends them
        future = fetch.future(pb.ParameterRequest(worker_id=f"w{i % num_workers}", min_version=2**62,
                                                  session=sessions[i % num_workers]))
        future.add_done_callback(on_done)
        futures.append(future)
    assert refused_all.wait(10)  # the calls over a cap are refused at once
    with lock:
        assert set(ended) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert server.polls.total == admitted
    status = call(client, "GetStatus")(pb.StatusRequest(), timeout=2)  # a free thread answers
    assert status.version == 0
    for future in futures:
        assert future.exception(timeout=WAIT_CAP_S + 10) is not None
    codes = [future.code() for future in futures]
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == admitted
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == num_calls - admitted
    assert server.polls.wait_for_total(0, 10)
    assert_unchanged(server, before)


def test_a_worker_over_its_long_poll_cap_is_refused_at_once(shard):
    server, client, plan = shard
    fetch = call(client, "FetchParameters")
    request = pb.ParameterRequest(worker_id="w0", min_version=5, session=client.shards[0].session)
    pending = [fetch.future(request, timeout=30) for _ in range(server.polls.per_key)]
    assert server.polls.wait_for_total(server.polls.per_key, 10)
    with pytest.raises(grpc.RpcError) as raised:  # long before its own deadline
        fetch(request, timeout=WAIT_CAP_S / 2)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "long-polls" in raised.value.details()
    # another worker still gets a slot, and a version that exists answers every waiter
    send = client.shards[0].channel.stream_unary(wire.method_path("SendGradients"),
                                                request_serializer=wire.identity,
                                                response_deserializer=pb.PushReply.FromString)
    for step in range(1, 6):
        send(frames(plan, torch.zeros(plan.numel), step=step, session=request.session), timeout=10)
    assert [f.result(timeout=10).header.version for f in pending] == [5] * len(pending)
    assert server.polls.wait_for_total(0, 10)


def test_poll_slots_count_per_key_and_in_total():
    slots = PollSlots(max_total=3, per_key=2)
    with slots.take("a"), slots.take("a"):
        with pytest.raises(RuntimeError, match="'a' already has 2"):
            slots.take("a")
        with slots.take("b"):
            with pytest.raises(RuntimeError, match="at most 3"):
                slots.take("c")
    assert slots.total == 0
    assert PollSlots.for_pool(32).max_total == 24


def stream(client):
    return client.shards[0].channel.stream_unary(wire.method_path("SendGradients"),
                                                request_serializer=wire.identity,
                                                response_deserializer=pb.PushReply.FromString)


def push_frames(plan, chunk_bytes, session, num_samples=8):
    """The frames of a push of ones by w0, cut in `chunk_bytes` pieces."""
    header = pb.GradientMessage(worker_id="w0", step=1, base_version=0, shard=0, num_samples=num_samples,
                                block_id=1, session=session)
    header.layout.extend(wire.slice_specs(plan))
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype="float32")
    data = codec.tensor_bytes(torch.ones(plan.numel))
    return codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta, data, chunk_bytes)


def endless(first, then, consumed):
    """`first`, then `then` forever, counting what gRPC read."""
    yield first
    for frame in itertools.repeat(then):
        consumed[0] += 1
        yield frame


def empty_frame():
    return bytes(next(iter(codec.encode_frames(pb.GradientMessage(), wire.GRADIENT_PAYLOAD_FIELD,
                                               tensor_pb2.TensorProto(), memoryview(b"")))))


def empty_header_frame(plan, session):
    """A push's first frame, whole header, no payload bytes (and not through shared memory)."""
    header = pb.GradientMessage(worker_id="w0", step=1, base_version=0, shard=0, num_samples=8, block_id=1,
                                session=session)
    header.layout.extend(wire.slice_specs(plan))
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype="float32")
    return next(iter(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta, memoryview(b""))))


def bad_streams(plan, session):
    one_byte = list(itertools.islice(push_frames(plan, 1, session), 2))
    first_frame = next(iter(push_frames(plan, codec.CHUNK_BYTES, session)))
    return {
        # endless streams: before these limits, the server read them until the deadline
        "empty frames": ("no payload bytes", lambda c: endless(one_byte[0], empty_frame(), c)),
        "one-byte frames": ("more than", lambda c: endless(one_byte[0], one_byte[1], c)),
        "too many bytes": ("exceeds", lambda c: endless(first_frame, first_frame, c)),
        "empty first frame": ("frame 1 carries no payload bytes",
                              lambda c: iter([empty_header_frame(plan, session)])),
        # a 2-byte field repeated: one view and one parsed field each
        "tiny fields": ("fields", lambda c: iter([b"\x78\x00" * 200_000 + first_frame])),
    }


@pytest.mark.parametrize("case", ["empty frames", "one-byte frames", "too many bytes", "empty first frame",
                                  "tiny fields"])
def test_a_push_over_a_bound_is_refused_and_the_stream_not_read_on(shard, case):
    server, client, plan = shard
    session = client.shards[0].session
    words, build = bad_streams(plan, session)[case]
    before = snapshot(server)
    consumed = [0]
    with pytest.raises(grpc.RpcError) as raised:
        stream(client)(build(consumed), timeout=20)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in raised.value.details()
    assert consumed[0] < 1_000_000  # the call ended although the stream never does
    assert_unchanged(server, before)
    assert server.state.status()["num_invalid"] == 0  # refused before it reached the shard
    # the next well-formed push goes through
    reply = stream(client)(frames(plan, torch.ones(plan.numel), session=session), timeout=10)
    assert reply.outcome == pb.PushReply.APPLIED


def test_push_limits_leave_room_for_every_legal_push():
    limits = push_limits(dense_nbytes=40 << 20, compressed_nbytes=None, num_slices=3)
    assert 40 << 20 <= limits.max_bytes <= 4 * (40 << 20)
    assert 40 <= limits.max_frames <= 4 * 80 + 4 and limits.max_fields >= 16 + 3
    assert push_limits(100, 180, 1).max_bytes >= 180  # a compressed layout larger than dense
    assert push_limits(10, None, 1).max_frames < 10  # not one frame per byte


@pytest.mark.parametrize("num_samples", [65, 2**62])
def test_a_push_standing_for_more_than_a_batch_is_refused(shard, num_samples):
    server, client, plan = shard
    batch_size, session = server.state.decoder.max_samples, client.shards[0].session
    assert batch_size == 64
    before = snapshot(server)
    with pytest.raises(grpc.RpcError) as raised:
        stream(client)(push_frames(plan, codec.CHUNK_BYTES, session, num_samples), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"num_samples ({num_samples}) exceeds the run's batch size (64)" in raised.value.details()
    assert_unchanged(server, before)
    assert server.state.status()["num_samples_applied"] == 0
    # a full batch is taken
    reply = stream(client)(push_frames(plan, codec.CHUNK_BYTES, session, batch_size), timeout=10)
    assert reply.outcome == pb.PushReply.APPLIED and server.state.status()["num_samples_applied"] == 64


@pytest.fixture
def momentum_shard(tmp_path):
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.9,
                     "learning_rate": 4.0, "checkpoint_interval": 2},
        "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt")}})
    yield from started(config)


def test_an_update_that_would_overflow_the_parameters_is_refused(momentum_shard):
    server, client, plan = momentum_shard
    send, session = stream(client), client.shards[0].session
    small = torch.full((plan.numel,), 0.01)
    assert send(frames(plan, small, step=1, session=session), timeout=10).outcome == pb.PushReply.APPLIED
    before = snapshot(server)
    assert "momentum_buffer" in before[2] and before[1] == 1 and before[3] == [1]
    huge = torch.full((plan.numel,), 1e38)  # finite, but 4.0 x 1e38 is not
    with pytest.raises(grpc.RpcError) as raised:
        send(frames(plan, huge, step=2, session=session), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NaN or infinite" in raised.value.details()
    assert_unchanged(server, before)
    status = call_status(server)
    assert status.num_refused_nonfinite == 1 and status.num_applied == 1
    # the same step with a sane gradient is taken afterwards: nothing of the refused one stayed
    reply = send(frames(plan, small, step=2, session=session), timeout=10)
    assert (reply.outcome, reply.version) == (pb.PushReply.APPLIED, 2)
    assert torch.isfinite(server.state.parameters()).all() and server.state.ledger(0, 0) == [1, 2]


def test_a_trickling_push_is_cancelled_at_the_servers_deadline(shard):
    server, client, plan = shard
    server.servicer.push_limits = dataclasses.replace(server.servicer.push_limits, max_read_s=1.0)
    session, before = client.shards[0].session, snapshot(server)
    pieces = list(itertools.islice(push_frames(plan, 1024, session), 2))
    never = threading.Event()

    def trickle():  # the first frames, then silence (the client's own deadline is far off)
        yield from pieces
        never.wait(30)

    with pytest.raises(grpc.RpcError) as raised:
        stream(client)(trickle(), timeout=30)
    never.set()
    assert raised.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert server.servicer.deadlines.num_cancelled == 1 and server.polls.wait_for_total(0, 10)
    assert_unchanged(server, before)


def test_a_stream_without_the_workers_session_is_not_read_past_its_first_frame(shard):
    server, client, plan = shard
    consumed = [0]
    frames_of_a_stranger = list(itertools.islice(push_frames(plan, 1024, b"guess" * 4), 2))
    with pytest.raises(grpc.RpcError) as raised:
        stream(client)(endless(frames_of_a_stranger[0], frames_of_a_stranger[1], consumed), timeout=20)
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert consumed[0] < 1000 and server.state.version == 0
