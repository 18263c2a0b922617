"""One shard server on a real socket (port 0) in this process, driven over gRPC.

Every malformed push is rejected with a status code and leaves parameters and version
as they were; long-polls wait for the version; checkpoints restore what was saved.
"""

import threading
from dataclasses import replace

import grpc
import pytest
import torch
from torch.nn.utils import parameters_to_vector

from disttrain.config import config_from_dict
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32  # worker w0's key in the shard fixture


def make_config(tmp_path, ps=None, **system):
    return config_from_dict({"ps": ps or {},
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.0,
                     "learning_rate": 0.5, "checkpoint_interval": 2},
        "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt"), **system}})


@pytest.fixture
def shard(tmp_path):
    config = make_config(tmp_path)
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0")
    model = init_model(config.training)
    plan = plan_shards(model, 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=2))
    client.register("w0", key=KEY)
    raw_send = client.shards[0].channel.stream_unary(wire.method_path("SendGradients"),
                                                    request_serializer=wire.identity,
                                                    response_deserializer=pb.PushReply.FromString)

    def send(pieces, **kwargs):  # as the registered worker w0 would
        return raw_send(signed(pieces, client.shards[0].session), **kwargs)

    yield server, client, plan, send
    client.close()
    server.stop(0)


def frames(plan, values, *, worker_id="w0", step=1, dtype="float32", shape=None, layout=None, data=None,
           session=b""):
    header = pb.GradientMessage(worker_id=worker_id, step=step, base_version=step - 1, shard=0,
                                num_samples=8, block_id=step, session=session)
    header.layout.extend(layout if layout is not None else wire.slice_specs(plan))
    meta = tensor_pb2.TensorProto(shape=shape or [plan.numel], dtype=dtype)
    payload = data if data is not None else codec.tensor_bytes(values)
    return iter(list(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta, payload)))


def signed(pieces, session):
    """The frames of a push, with `session` in their header unless it carries one."""
    first, *rest = list(pieces)
    header = pb.GradientMessage.FromString(first)
    if not header.session:
        header.session = session
    return iter([header.SerializeToString(), *rest])


def wrong_shape_layout(plan):
    specs = wire.slice_specs(plan)
    specs[0].shape[0] += 1
    return specs


def unknown_name_layout(plan):
    specs = wire.slice_specs(plan)
    specs[1].name = "net.9.weight"
    return specs


MALFORMED = {
    "wrong shape": (grpc.StatusCode.INVALID_ARGUMENT, "does not match",
                    lambda plan, g: frames(plan, g, layout=wrong_shape_layout(plan))),
    "wrong payload shape": (grpc.StatusCode.INVALID_ARGUMENT, "payload shape",
                            lambda plan, g: frames(plan, g, shape=[plan.numel - 1, 1])),
    "wrong dtype": (grpc.StatusCode.INVALID_ARGUMENT, "dtype",
                    lambda plan, g: frames(plan, g, dtype="float64", data=codec.tensor_bytes(g.double()))),
    "truncated bytes": (grpc.StatusCode.INVALID_ARGUMENT, "truncated",
                        lambda plan, g: frames(plan, g, data=codec.tensor_bytes(g)[:-4])),
    "NaN": (grpc.StatusCode.INVALID_ARGUMENT, "NaN",
            lambda plan, g: frames(plan, torch.where(torch.arange(g.numel()) == 7, float("nan"), g))),
    "unknown worker": (grpc.StatusCode.FAILED_PRECONDITION, "unknown worker",
                       lambda plan, g: frames(plan, g, worker_id="intruder")),
    "unknown name": (grpc.StatusCode.INVALID_ARGUMENT, "unknown tensor name",
                     lambda plan, g: frames(plan, g, layout=unknown_name_layout(plan))),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_push_is_rejected_and_changes_nothing(shard, case):
    server, client, plan, send = shard
    code, words, build = MALFORMED[case]
    before = server.state.parameters()
    with pytest.raises(grpc.RpcError) as raised:
        send(build(plan, torch.ones(plan.numel)), timeout=10)
    assert raised.value.code() == code and words in raised.value.details()
    assert server.state.version == 0 and torch.equal(server.state.parameters(), before)
    # the same worker's next well-formed push still goes through
    assert send(frames(plan, torch.ones(plan.numel)), timeout=10).outcome == pb.PushReply.APPLIED
    assert server.state.version == 1


def test_push_applies_sgd_and_pull_returns_the_new_version(shard):
    server, client, plan, send = shard
    start = server.state.parameters()
    gradient = torch.randn(plan.numel)
    reply = send(frames(plan, gradient), timeout=10)
    assert (reply.outcome, reply.version, reply.staleness) == (pb.PushReply.APPLIED, 1, 0)
    again = send(frames(plan, gradient), timeout=10)  # a retried push is not applied twice
    assert again.outcome == pb.PushReply.DUPLICATE and server.state.version == 1
    flat = torch.empty(plan.numel)
    assert client.pull("w0", flat, [1]) == [1]
    torch.testing.assert_close(flat, start - 0.5 * gradient, rtol=0, atol=1e-6)


def test_long_poll_waits_for_the_version_without_polling(shard):
    server, client, plan, send = shard
    flat = torch.empty(plan.numel)
    got = {}
    waiting = threading.Thread(target=lambda: got.update(v=client.pull("w0", flat, [1])))
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive()  # version 1 does not exist yet
    send(frames(plan, torch.zeros(plan.numel)), timeout=10)
    waiting.join(timeout=10)
    assert got["v"] == [1]


def test_long_poll_ends_with_deadline_exceeded(shard):
    server, client, plan, send = shard
    call = client.shards[0].channel.unary_stream(wire.method_path("GetParameters"),
                                                request_serializer=pb.ParameterRequest.SerializeToString,
                                                response_deserializer=wire.read_parameters)
    with pytest.raises(grpc.RpcError) as raised:
        list(call(pb.ParameterRequest(worker_id="w0", min_version=5, session=client.shards[0].session),
                  timeout=0.5))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_checkpoints_restore_parameters_optimizer_and_version(tmp_path, shard):
    server, client, plan, send = shard
    for step in range(1, 4):
        send(frames(plan, torch.full((plan.numel,), float(step)), step=step), timeout=10)
    server.state.flush_checkpoints()
    expected = server.state.parameters()
    server.stop(0)  # writes the final checkpoint (version 3)
    restored = build_state(make_config(tmp_path), 0, 1, resume=True)
    assert restored.version == 3 and torch.equal(restored.parameters(), expected)
    assert restored.rules.ranks == {"w0": 0}


def test_fresh_run_refuses_a_checkpoint_dir_of_an_earlier_run(tmp_path, shard):
    server, client, plan, send = shard
    send(frames(plan, torch.ones(plan.numel)), timeout=10)
    send(frames(plan, torch.ones(plan.numel), step=2), timeout=10)
    server.state.flush_checkpoints()
    with pytest.raises(Exception, match="already holds checkpoints"):
        build_state(make_config(tmp_path), 0, 1)


def test_worker_with_another_model_is_refused_at_registration(tmp_path, shard):
    server, client, plan, send = shard
    other = plan_shards(torch.nn.Linear(3, 2), 1)
    stranger = PSClient([server.address], other, RetryPolicy(timeout_s=5.0, max_attempts=1))
    with pytest.raises(Exception, match="different model"):
        stranger.register("w0", key=KEY)  # the same worker, restarted with another model
    stranger.close()


def test_sync_shard_averages_two_workers_by_samples(tmp_path):
    config = make_config(tmp_path, num_workers=2)
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    plan = state.plan
    start = state.parameters()
    clients = [PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0)) for _ in range(2)]
    grads = [torch.randn(plan.numel), torch.randn(plan.numel)]
    weights = [8, 24]
    try:
        for rank, c in enumerate(clients):
            assert c.register(f"w{rank}").rank == rank
        replies = [None, None]

        def push(rank):
            header = pb.GradientMessage(worker_id=f"w{rank}", step=1, base_version=0, shard=0,
                                        num_samples=weights[rank], block_id=rank)
            replies[rank] = clients[rank].push([header], grads[rank], [0])[0]

        threads = [threading.Thread(target=push, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert sorted(r.outcome for r in replies) == [pb.PushReply.APPLIED, pb.PushReply.BUFFERED]
        expected = start - 0.5 * (grads[0] * 0.25 + grads[1] * 0.75)
        torch.testing.assert_close(state.parameters(), expected, rtol=0, atol=1e-6)
        assert state.status()["num_samples_applied"] == 32
    finally:
        for c in clients:
            c.close()
        server.stop(0)


def test_initial_parameters_are_the_seeded_model(tmp_path):
    config = make_config(tmp_path)
    state = build_state(config, 0, 1)
    assert torch.equal(state.parameters(), parameters_to_vector(init_model(config.training).parameters()))


def test_ssp_worker_recomputes_a_rejected_gradient_on_fresh_parameters(tmp_path):
    from disttrain.metrics.window import StepTimer
    from disttrain.strategies.ps.worker.exchange import Block, ExchangeRules, WorkerTensors, make_exchange
    from disttrain.training.engine import StepResult

    config = make_config(tmp_path, num_workers=2, ps={"aggregation_mode": "ssp", "staleness": 0})
    config = replace(config, ps=replace(config.ps, ssp_clock="versions"))  # the bound on versions refuses
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    plan = state.plan
    clients = [PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0)) for _ in range(2)]
    try:
        exchanges = []
        for rank, c in enumerate(clients):
            c.register(f"w{rank}", rank)
            flat, grads = torch.zeros(plan.numel), torch.ones(plan.numel)
            exchanges.append(make_exchange(c, f"w{rank}", WorkerTensors(flat, grads), ExchangeRules("ssp")))
            exchanges[-1].start()
        computed = []

        def compute(rank):
            computed.append((rank, exchanges[rank].versions[0]))
            return StepResult(0.0, 0, 8)

        exchanges[0].step(lambda: compute(0), Block(1, 0, 0, 8), StepTimer())  # version 0 -> 1
        # on version 0: rejected, redone on 1
        exchanges[1].step(lambda: compute(1), Block(1, 1, 0, 8), StepTimer())
        assert computed == [(0, 0), (1, 0), (1, 1)]
        assert exchanges[1].num_rejected == 1 and state.version == 2
        assert state.status()["num_rejected_stale"] == 1
    finally:
        for c in clients:
            c.close()
        server.stop(0)
