"""Every resource that callers share is shared per caller, on real servers (port 0) called
by raw gRPC clients holding node tokens of the run's secret: an insider (worker1, with
its own valid token and session) that takes every slot, stream, watch and barrier it can
is refused RESOURCE_EXHAUSTED past its own share, while an honest caller beside it is
served; a barrier nobody waits at expires; and a node never takes another's rank or id
at the coordinator, while a node restarted under its own id registers again.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.service import WATCHES_PER_CALLER, CoordinatorServer
from disttrain.core.auth import METADATA_KEY, SCHEME, new_token
from disttrain.core.credentials import Credentials
from disttrain.core.identity import node_token
from disttrain.core.poll_slots import PollLimitExceeded, PollSlots
from disttrain.proto import coordinator_pb2 as cpb
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.barriers import EXPIRY_S, PENDING_PER_WORKER
from disttrain.strategies.ps.server.limits import OPENINGS_PER_CALLER, POLLS_PER_CALLER, POLLS_PER_WORKER
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(120)

SECRET = new_token()
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# A long-poll that waited its deadline out: answered as it ran out, or cut by the deadline.
WAITED = {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
COORDINATOR = "/disttrain.v1.CoordinatorService/"


def credentials(node_id: str | None, role: str = "worker") -> list[tuple[str, str]]:
    """The metadata of node `node_id` in `role` (None: the operator, holding the secret)."""
    token = SECRET if node_id is None else node_token(SECRET, node_id, role)
    return [(METADATA_KEY, SCHEME + token)]


def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether `condition` came true within `timeout_s` (checked as the servers move on)."""
    deadline, tick = time.monotonic() + timeout_s, threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.01)
    return True


@dataclass
class Held:
    """Calls an insider opened and left waiting: those the server took in, those it refused."""

    calls: list = field(default_factory=list)
    refused: list[grpc.StatusCode] = field(default_factory=list)

    def open(self, make_call: Callable[[], grpc.Future], held_now: Callable[[], int]) -> None:
        """Make a call and keep it open; return once the server holds it (`held_now` went
        up from before the call was made) or ended it."""
        before, ended = held_now(), threading.Event()
        call = make_call()
        call.add_done_callback(lambda c: ended.set())
        assert until(lambda: ended.is_set() or held_now() > before), "the call was neither held nor ended"
        if ended.is_set():
            self.refused.append(call.code())
        else:
            self.calls.append(call)

    def close(self) -> None:
        for call in self.calls:
            call.cancel()


# --- a shard ---------------------------------------------------------------------------

@dataclass
class Shard:
    server: ShardServer
    channel: grpc.Channel
    sessions: dict[str, bytes]
    plan: object
    stopped: bool = False

    def stop(self) -> None:
        """Stop the server (once): its long-polls wake, and every call ends."""
        if not self.stopped:
            self.stopped = True
            self.server.stop(0)

    def stub(self, method: str, kind: str = "unary_unary", response=wire.identity):
        framed = method in ("Step", "SendGradients")
        serializer = wire.identity if framed else (lambda message: message.SerializeToString())
        return getattr(self.channel, kind)(wire.method_path(method), request_serializer=serializer,
                                           response_deserializer=response)

    def push_frames(self, worker_id: str, step: int, block: int) -> list[bytes]:
        header = pb.GradientMessage(worker_id=worker_id, step=step, base_version=0, shard=0, num_samples=8,
                                    block_id=block, session=self.sessions[worker_id])
        header.layout.extend(wire.slice_specs(self.plan))
        meta = tensor_pb2.TensorProto(shape=[self.plan.numel], dtype="float32")
        return list(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta,
                                        codec.tensor_bytes(torch.full((self.plan.numel,), 0.01))))


@pytest.fixture
def shard(tmp_path) -> Iterator[Shard]:
    """A shard (async, three workers) requiring the run's credentials, its long-polls
    waiting up to 30 s and its streams' first message up to 30 s (an insider's calls stay
    held through a test); worker0, worker1 (the insider) and worker2 registered."""
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd",
                     "learning_rate": 0.1, "checkpoint_interval": 1000},
        "system": {"num_workers": 3, "checkpoint_dir": str(tmp_path / "ckpt")},
        "ps": {"aggregation_mode": "async"}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0", max_threads=32,
                         credentials=Credentials(SECRET), long_poll_cap_s=30.0, first_message_s=30.0)
    channel = grpc.insecure_channel(server.address)
    target = Shard(server, channel, {}, plan_shards(init_model(config.training), 1)[0])
    register = target.stub("RegisterWorker", response=pb.WorkerAssignment.FromString)
    for rank, worker_id in enumerate(("worker0", "worker1", "worker2")):
        request = pb.RegisterRequest(worker_id=worker_id, requested_rank=rank, key=bytes([rank]) * 32)
        assignment = register(request, timeout=10, metadata=credentials(worker_id))
        target.sessions[worker_id] = assignment.session
    yield target
    channel.close()
    target.stop()


def silent(stop: threading.Event) -> Iterator[bytes]:
    stop.wait()
    yield from ()


def test_an_insider_gets_its_own_share_of_the_shard_and_an_honest_worker_beside_it_is_served(shard):
    """worker1 opens silent streams, a push it never finishes, observing waits, waits for
    all done and a pull of a version that never comes, each past its share: the extra
    ones are refused at once, its held ones stop at `POLLS_PER_CALLER` over all its keys,
    and worker0 still pushes on a stream and waits at a barrier, and the operator still
    observes."""
    polls, insider, stop = shard.server.polls, Held(), threading.Event()
    as_insider, session = credentials("worker1"), shard.sessions["worker1"]
    step = shard.stub("Step", "stream_stream")
    status = shard.stub("GetStatus", response=pb.ShardStatus.FromString)
    pull = shard.stub("FetchParameters")

    def first_frame_only() -> Iterator[bytes]:
        yield shard.push_frames("worker1", 1, 1)[0]
        stop.wait()

    try:
        push = shard.stub("SendGradients", "stream_unary").future(first_frame_only(), timeout=60,
                                                                  metadata=as_insider)
        assert until(lambda: polls.held("worker1 (push)") == 1)  # read on, on its own slot
        insider.calls.append(push)
        for _ in range(shard.server.servicer.max_opening + 2):  # more than the whole server's openings
            insider.open(lambda: step(silent(stop), timeout=60, metadata=as_insider), lambda: polls.total)
        assert len(insider.calls) == 1 + OPENINGS_PER_CALLER and set(insider.refused) == {EXHAUSTED}
        def wait(stub, request) -> Callable[[], grpc.Future]:
            return lambda: stub.future(request, timeout=60, metadata=as_insider)

        for _ in range(POLLS_PER_WORKER + 2):  # observing, naming no worker
            insider.open(wait(status, pb.StatusRequest(wait_all_done=True)), lambda: polls.total)
        for _ in range(POLLS_PER_WORKER):  # waiting for all done, as itself
            mine = pb.StatusRequest(wait_all_done=True, worker_id="worker1", session=session)
            insider.open(wait(status, mine), lambda: polls.total)
        never = pb.ParameterRequest(worker_id="worker1", session=session, shard=0, min_version=10**6)
        insider.open(wait(pull, never), lambda: polls.total)  # a version that never comes
        assert polls.held_by("worker1 (worker)") == POLLS_PER_CALLER == len(insider.calls)
        with pytest.raises(grpc.RpcError) as over:  # one more wait, on a key not full: over its share
            shard.stub("Barrier")(pb.BarrierRequest(worker_id="worker1", session=session,
                                                    name="epoch0:trained", values=[1.0]),
                                  timeout=10, metadata=as_insider)
        assert over.value.code() == EXHAUSTED and "per caller" in over.value.details()
        assert set(insider.refused) == {EXHAUSTED}

        # beside it, the others are served: worker0's push on a stream of its own ...
        reply = shard.stub("SendGradients", "stream_unary", pb.PushReply.FromString)(
            iter(shard.push_frames("worker0", 1, 0)), timeout=10, metadata=credentials("worker0"))
        assert pb.PushReply.Outcome.Name(reply.outcome) == "APPLIED"
        # ... its wait at a barrier beside worker2's (worker1 never comes: both wait) ...
        meet = shard.stub("Barrier", response=pb.BarrierReply.FromString)
        waits = [meet.future(pb.BarrierRequest(worker_id=w, session=shard.sessions[w], name="met",
                                               values=[1.0]), timeout=2.0, metadata=credentials(w))
                 for w in ("worker0", "worker2")]
        assert until(lambda: shard.server.state.barriers.pending == ["met"])
        # ... and the operator's observing wait: it waits (until its deadline), not refused
        observing = status.future(pb.StatusRequest(wait_all_done=True), timeout=1.0,
                                  metadata=credentials(None))
        assert observing.code() in WAITED
        for wait in waits:
            assert wait.code() in WAITED  # worker1 never came: waited, not refused
    finally:
        stop.set()
        insider.close()
        shard.stop()
    assert polls.wait_for_total(0, 30)  # every slot let go as its call ended
    assert shard.server.servicer.openings.total == 0


def test_an_insider_waits_at_only_its_share_of_barriers_and_the_others_meet(shard):
    """worker1 arrives at more made-up barriers than a worker may wait at: past its share
    it is refused (RESOURCE_EXHAUSTED, naming its barriers), and worker0 and worker2 still
    start and wait at theirs."""
    meet = shard.stub("Barrier", response=pb.BarrierReply.FromString)

    def arrive(worker_id: str, name: str, timeout_s: float) -> grpc.StatusCode:
        try:
            meet(pb.BarrierRequest(worker_id=worker_id, session=shard.sessions[worker_id], name=name,
                                   values=[1.0]), timeout=timeout_s, metadata=credentials(worker_id))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    codes = [arrive("worker1", f"made-up{i}", 0.3) for i in range(2 * PENDING_PER_WORKER + 2)]
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * PENDING_PER_WORKER \
        + [EXHAUSTED] * (PENDING_PER_WORKER + 2)
    for worker_id in ("worker0", "worker2"):  # each arrives and waits: not refused
        assert arrive(worker_id, "epoch0:trained", 0.3) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "epoch0:trained" in shard.server.state.barriers.pending
    assert len(shard.server.state.barriers.pending) == PENDING_PER_WORKER + 1


def test_a_pending_barrier_nobody_waits_at_expires(shard):
    """worker1 leaves a made-up barrier; once nobody has waited at it for EXPIRY_S (the
    shard's clock, stepped here) it is forgotten, while worker0's, renewed by its waits,
    stays; worker1's share is free again."""
    state, now = shard.server.state, [1000.0]
    state.clock = lambda: now[0]
    meet = shard.stub("Barrier")

    def arrive(worker_id: str, name: str) -> None:
        with pytest.raises(grpc.RpcError) as waited:
            meet(pb.BarrierRequest(worker_id=worker_id, session=shard.sessions[worker_id], name=name,
                                   values=[1.0]), timeout=0.3, metadata=credentials(worker_id))
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    for i in range(PENDING_PER_WORKER):
        arrive("worker1", f"left-behind{i}")
    arrive("worker0", "epoch0:trained")
    now[0] += EXPIRY_S / 2
    arrive("worker0", "epoch0:trained")  # worker0 still waits: its long-poll renews its arrival
    now[0] += EXPIRY_S / 2 + 1
    arrive("worker0", "epoch0:trained")
    assert state.barriers.pending == ["epoch0:trained"] and state.barriers.num_expired == PENDING_PER_WORKER
    arrive("worker1", "epoch1:trained")  # its share is its own again


# --- the coordinator -------------------------------------------------------------------

@pytest.fixture
def coordinator(tmp_path) -> Iterator[tuple[CoordinatorServer, grpc.Channel]]:
    config = CoordinatorConfig(heartbeat_interval=60.0, heartbeat_timeout=3600.0, reassign_after=None)
    server = CoordinatorServer(config, "127.0.0.1:0", tmp_path / "cluster.db", max_threads=8,
                               credentials=Credentials(SECRET))
    channel = grpc.insecure_channel(server.address)
    yield server, channel
    channel.close()
    server.stop(0)


def coordinator_stub(channel: grpc.Channel, method: str, reply):
    return channel.unary_unary(COORDINATOR + method, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=reply.FromString)


def test_an_insider_holds_only_its_own_membership_watches(coordinator):
    """worker1 opens more watches than the whole coordinator holds: past its share they are
    refused, and worker0's watch is still answered."""
    server, channel = coordinator
    watch = coordinator_stub(channel, "WatchMembership", cpb.Membership)
    insider, watches = Held(), server.servicer.watches
    try:
        for _ in range(watches.max_total + 2):
            insider.open(lambda: watch.future(cpb.MembershipRequest(after_generation=0), timeout=60,
                                      metadata=credentials("worker1")), lambda: watches.total)
        assert len(insider.calls) == WATCHES_PER_CALLER and set(insider.refused) == {EXHAUSTED}
        answer = watch(cpb.MembershipRequest(after_generation=0), timeout=1.0,
                       metadata=credentials("worker0"))
        assert answer.generation == 0  # waited its deadline out, served
    finally:
        insider.close()


def test_a_node_takes_no_other_nodes_rank_or_id_and_its_own_restart_registers_again(coordinator):
    server, channel = coordinator
    register = coordinator_stub(channel, "RegisterNode", cpb.RegisterNodeReply)
    report_exit = coordinator_stub(channel, "ReportExit", cpb.ExitReply)

    def as_node(caller: str, node_id: str, rank: int, pid: int) -> grpc.StatusCode:
        try:
            register(cpb.RegisterNodeRequest(node_id=node_id, role="worker", rank=rank, pid=pid),
                     timeout=10, metadata=credentials(caller))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    pid = os.getpid()
    assert as_node("worker0", "worker0", 0, pid) == grpc.StatusCode.OK
    assert as_node("worker1", "worker1", 1, pid + 1) == grpc.StatusCode.OK
    generation = server.state.membership.get("worker0").joined_generation
    # worker0 failed: its restart is on its way
    report_exit(cpb.ExitReport(node_id="worker0", exit_code=1, reason="killed", pid=pid,
                               generation=generation), timeout=10, metadata=credentials("worker0"))
    assert as_node("worker1", "worker0", 0, pid + 1) == grpc.StatusCode.PERMISSION_DENIED  # another's id
    assert as_node("worker1", "worker1", 0, pid + 1) == grpc.StatusCode.ALREADY_EXISTS  # another's rank
    assert as_node("worker2", "worker2", 0, pid + 2) == grpc.StatusCode.ALREADY_EXISTS  # a newcomer's too
    members = {m.node_id: m.rank for m in server.state.membership.members()}
    assert members == {"worker0": 0, "worker1": 1}
    assert as_node("worker0", "worker0", 0, pid + 3) == grpc.StatusCode.OK  # its own restart
    restarted = server.state.membership.get("worker0")
    assert restarted.state == "alive" and restarted.restarts == 1 and restarted.pid == pid + 3


# --- the rule itself -------------------------------------------------------------------

def test_poll_slots_bound_each_owner_over_all_its_keys():
    slots = PollSlots(max_total=10, per_key=2, per_owner=3)
    held = [slots.take(key, owner="w1") for key in ("w1 pulls", "w1 pulls", "w1 push")]
    with pytest.raises(PollLimitExceeded, match="at most 3 per caller"):
        slots.take("w1 barrier", owner="w1")
    trusted = [slots.take("operator", per_key=10) for _ in range(5)]  # no owner: the totals alone
    assert slots.take("w0 pulls", owner="w0") is not None and slots.total == 9
    with held[0]:
        pass
    assert slots.held_by("w1") == 2 and slots.take("w1 barrier", owner="w1") is not None
    assert len(trusted) == 5
