"""Identity that can't be spoofed, on a real shard server (port 0): a worker id is bound
to the key it registered with, and its calls carry the session its registration
returned. Each attack ends with the model, version, optimizer state and ledger as they
were, the server answering, and the victim training on."""

import threading

import grpc
import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.server.shard import WorkerClaim
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model
from tests.distributed.test_ps_limits import assert_unchanged, call, snapshot, started
from tests.distributed.test_ps_server import frames

pytestmark = pytest.mark.timeout(60)

VICTIM_KEY = b"v" * 32


def momentum_config(tmp_path, num_workers=2):
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.9,
                     "learning_rate": 0.1, "checkpoint_interval": 1},
        "system": {"num_workers": num_workers, "checkpoint_dir": str(tmp_path / "ckpt")},
        "ps": {"aggregation_mode": "async"}})


@pytest.fixture
def shard(tmp_path):
    """A shard whose victim w0 has pushed step 1 (so momentum and the ledger hold something)."""
    for server, client, plan in started(momentum_config(tmp_path)):
        client.shards[0].segments = None  # its pushes go through gRPC, where the attacks are
        victim = client.shards[0]
        assert push(client, plan, frames(plan, torch.ones(plan.numel), session=victim.session)).version == 1
        yield server, client, plan


def push(client, plan, pieces):
    send = client.shards[0].channel.stream_unary(wire.method_path("SendGradients"),
                                                request_serializer=wire.identity,
                                                response_deserializer=pb.PushReply.FromString)
    return send(pieces, timeout=10)


def register(client, worker_id, key, generation=0, shared_memory=False):
    call = client.shards[0].channel.unary_unary(wire.method_path("RegisterWorker"),
                                                request_serializer=pb.RegisterRequest.SerializeToString,
                                                response_deserializer=pb.WorkerAssignment.FromString)
    return call(pb.RegisterRequest(worker_id=worker_id, requested_rank=-1, key=key, generation=generation,
                                   shared_memory=shared_memory), timeout=10)


def refused(code, words, attempt):
    with pytest.raises(grpc.RpcError) as raised:
        attempt()
    assert raised.value.code() == code, raised.value.details()
    assert words in raised.value.details()


def victim_goes_on(client, plan, step=2):
    session = client.shards[0].session
    reply = push(client, plan, frames(plan, torch.ones(plan.numel), step=step, session=session))
    assert reply.outcome == pb.PushReply.APPLIED


@pytest.mark.parametrize("session", [b"", b"x" * 16], ids=["no session", "a guessed session"])
def test_a_push_as_another_worker_is_refused(shard, session):
    server, client, plan = shard
    before = snapshot(server)
    spoof = frames(plan, torch.full((plan.numel,), 5.0), step=2, session=session)
    refused(grpc.StatusCode.PERMISSION_DENIED, "current session", lambda: push(client, plan, spoof))
    assert_unchanged(server, before)
    victim_goes_on(client, plan)


def test_a_step_from_far_ahead_is_refused_not_recorded(shard):
    server, client, plan = shard
    before = snapshot(server)
    far = frames(plan, torch.ones(plan.numel), step=2**62, session=client.shards[0].session)
    refused(grpc.StatusCode.FAILED_PRECONDITION, "ahead of its last step", lambda: push(client, plan, far))
    assert_unchanged(server, before)
    victim_goes_on(client, plan)  # not answered DUPLICATE: the far step left no trace


def test_pulls_done_and_barriers_need_the_session(shard):
    server, client, plan = shard
    before = snapshot(server)
    fetch = call(client, "FetchParameters")
    refused(grpc.StatusCode.PERMISSION_DENIED, "current session",
            lambda: fetch(pb.ParameterRequest(worker_id="w0", min_version=0), timeout=10))
    refused(grpc.StatusCode.FAILED_PRECONDITION, "unknown worker",  # pulls check registration too
            lambda: fetch(pb.ParameterRequest(worker_id="nobody", min_version=0), timeout=10))
    done = client.shards[0].channel.unary_unary(wire.method_path("WorkerDone"),
                                                request_serializer=pb.WorkerDoneRequest.SerializeToString,
                                                response_deserializer=pb.ShardStatus.FromString)
    refused(grpc.StatusCode.PERMISSION_DENIED, "current session",
            lambda: done(pb.WorkerDoneRequest(worker_id="w0"), timeout=10))
    barrier = client.shards[0].channel.unary_unary(wire.method_path("Barrier"),
                                                   request_serializer=pb.BarrierRequest.SerializeToString,
                                                   response_deserializer=pb.BarrierReply.FromString)
    refused(grpc.StatusCode.PERMISSION_DENIED, "current session",
            lambda: barrier(pb.BarrierRequest(worker_id="w0", name="start"), timeout=10))
    assert server.state.status()["num_done"] == 0 and server.state.barriers.result("start") is None
    assert_unchanged(server, before)
    flat = torch.empty(plan.numel)
    assert client.pull("w0", flat, [1]) == [1]  # the victim's own pull


def test_a_live_id_cannot_be_registered_again_with_another_key(shard):
    server, client, plan = shard
    before, segments = snapshot(server), server.state.segments.of("w0")
    refused(grpc.StatusCode.ALREADY_EXISTS, "registered by another live worker",
            lambda: register(client, "w0", b"attacker" * 4, shared_memory=True))
    assert server.state.segments.of("w0") is segments  # its shared memory was not replaced
    assert_unchanged(server, before)
    victim_goes_on(client, plan)


@pytest.mark.parametrize("worker_id, key, words", [("", b"k" * 32, "worker_id must be"),
                                                   ("w\n", b"k" * 32, "printable"),
                                                   ("w9", b"short", "at least 16")])
def test_a_malformed_identity_is_refused_at_registration(shard, worker_id, key, words):
    server, client, plan = shard
    refused(grpc.StatusCode.INVALID_ARGUMENT, words, lambda: register(client, worker_id, key))
    assert server.state.status()["num_registered"] == 1


@pytest.fixture
def keyed(tmp_path):
    """A shard of `momentum_config`, and a client registered as w0 with VICTIM_KEY."""
    config = momentum_config(tmp_path)
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0")
    plan = plan_shards(init_model(config.training), 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=1))
    client.register("w0", key=VICTIM_KEY)
    yield server, client, plan, config
    client.close()
    server.stop(0)


def test_the_same_key_takes_its_id_back_and_the_old_session_stops(keyed):
    server, client, plan, _ = keyed
    old = client.shards[0].session
    again = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=1))
    try:
        assert again.register("w0", key=VICTIM_KEY).rank == 0  # the worker restarted with --resume
        assert again.shards[0].session != old
        stale = frames(plan, torch.ones(plan.numel), session=old)
        refused(grpc.StatusCode.PERMISSION_DENIED, "current session", lambda: push(client, plan, stale))
    finally:
        again.close()


def test_a_restart_takes_the_id_over_only_in_a_generation_the_coordinator_confirms(keyed):
    server, client, _, _ = keyed
    server.state.set_membership(3, {"w0": 3})

    def take_over(generation):
        return register(client, "w0", b"n" * 32, generation=generation)

    refused(grpc.StatusCode.ALREADY_EXISTS, "another live worker", lambda: take_over(0))
    refused(grpc.StatusCode.UNAVAILABLE, "on its way", lambda: take_over(5))
    server.state.set_membership(5, {"w0": 4})  # w0 rejoined in 4, not in 5
    refused(grpc.StatusCode.ALREADY_EXISTS, "another live worker", lambda: take_over(5))
    server.state.set_membership(6, {"w0": 6})
    assert take_over(6).rank == 0


def test_a_restarted_shard_still_knows_who_holds_each_id(keyed):
    server, client, plan, config = keyed
    server.stop(0)  # its final checkpoint
    server = ShardServer(build_state(config, 0, 1, resume=True), "127.0.0.1:0")
    fresh = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=1))
    try:
        refused(grpc.StatusCode.ALREADY_EXISTS, "another live worker",
                lambda: register(fresh, "w0", b"attacker" * 4))
        assert fresh.register("w0", key=VICTIM_KEY).rank == 0
    finally:
        fresh.close()
        server.stop(0)


class PeerContext:
    """The one thing RegisterWorker reads of its gRPC context: where the call came from."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_shared_memory_is_offered_to_workers_on_this_host_only(tmp_path):
    from disttrain.core.poll_slots import PollSlots
    from disttrain.strategies.ps.server.servicer import ParameterServicer
    from disttrain.strategies.ps.wire.shared_memory import available

    if not available():
        pytest.skip("no /dev/shm here")
    state = build_state(momentum_config(tmp_path), 0, 1)
    servicer = ParameterServicer(state, threading.Event(), PollSlots.for_pool(32, 2))
    try:
        request = pb.RegisterRequest(worker_id="far", requested_rank=-1, key=b"f" * 32, shared_memory=True)
        far = servicer.RegisterWorker(request, PeerContext("ipv4:192.0.2.7:41000"))
        assert not far.HasField("shared_memory")
        assert state.segments.of("far") is None
        request = pb.RegisterRequest(worker_id="near", requested_rank=-1, key=b"n" * 32, shared_memory=True)
        assert servicer.RegisterWorker(request, PeerContext("ipv4:127.0.0.1:41000")).HasField("shared_memory")
    finally:
        state.stop()


def test_a_round_completed_by_a_leaving_worker_that_would_overflow_is_voided(tmp_path):
    config = momentum_config(tmp_path).replace(ps={"aggregation_mode": "sync"},
                                               training={"learning_rate": 4.0})
    state = build_state(config, 0, 1)
    sessions = [state.register(WorkerClaim(f"w{r}", bytes([65 + r]) * 32, 0), r).session for r in range(2)]
    before = state.parameters()
    huge = frames(state.plan, torch.full((state.plan.numel,), 1e38), session=sessions[0])
    payload = wire.collect_payload((wire.read_gradient(raw) for raw in huge), 2 * state.plan.nbytes)
    assert state.push(payload).outcome.name == "BUFFERED"
    state.worker_done("w1", sessions[1])  # the round completes without w1: its update overflows
    status = state.status()
    assert status["version"] == 1  # the waiting worker goes on
    assert status["num_refused_nonfinite"] == 1 and status["num_samples_applied"] == 0
    assert state.ledger(0, 0) == [] and torch.equal(state.parameters(), before)  # its block is redone later
    state.stop()
