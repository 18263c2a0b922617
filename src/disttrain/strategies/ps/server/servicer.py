"""One parameter-server shard on the wire: a thin gRPC servicer over `ShardState`, and the
server that serves it.

The servicer decodes requests, calls the shard, and answers each refusal with its status
code (`CODES`): retry later (UNAVAILABLE), register again or stop (PERMISSION_DENIED,
ALREADY_EXISTS), fix the call (INVALID_ARGUMENT), or follow the protocol
(FAILED_PRECONDITION). A refused call changes nothing on the shard.

Step trades a push for the parameters it leads to in one round trip, on a stream the
worker keeps open for the run: each request is handled as PushGradients handles it (the
same decoding, bounds, session check and rules); its reply then waits, as a pull would,
for the version the push leads to: in sync mode the step the push joined, once applied
(`ShardState.step_applied`), otherwise none (the parameters as they are, this push
included). In SSP by steps, a push's reply (Step's, or a push's alone) is held while its
worker is more than the bound ahead of the slowest (`ShardState.step_allowed`), on one
of the worker's long-poll slots; past the long-poll cap the call ends DEADLINE_EXCEEDED
and the worker's retry (a duplicate, changing nothing) waits again, as a synchronous
step's does.
The stream holds one of the worker's long-poll slots while it is open, taken once its
first push passed the session check.

A stream shows no worker until its first message: that must come within
`first_message_s`, on one of its caller's few opening slots (the node its credentials
name: `limits.OPENINGS_PER_CALLER`) among the few all callers' opening streams may hold
(`limits.opening_slots`), and a push of an earlier server incarnation is answered
ROLLED_BACK from its first frame, the rest unread (a Step stream gets a few of those
before a push passes the session check).

Every long-poll is held under its caller's share (`core.poll_slots`): per key (a
worker's pulls, pushes, steps, waits), per caller over all its keys
(`limits.POLLS_PER_CALLER`), and in total; refusals are logged per caller
(`RefusalLog.of`). One caller holding a valid credential thus takes only its own share of
the server, whatever it opens and leaves silent.
"""

from __future__ import annotations

import itertools
import logging
import threading
from contextlib import ExitStack, nullcontext

import grpc

from disttrain.core.addresses import peer_is_local
from disttrain.core.credentials import Credentials
from disttrain.core.deadlines import Deadlines
from disttrain.core.identity import NotPermitted
from disttrain.core.poll_slots import PollLimitExceeded, PollSlots, caller_key
from disttrain.core.refusal_log import RefusalLog, printable
from disttrain.core.rpc_access import GRANT_ATTRIBUTE, Unread, authorize_message
from disttrain.core.rpc_server import RpcServer, ServerLimits
from disttrain.core.rpc_server import refusals as rpc_refusals
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.server.barriers import TooManyBarriers
from disttrain.strategies.ps.server.decisions import PushRefused
from disttrain.strategies.ps.server.limits import (
    FIRST_MESSAGE_S,
    LONG_POLL_CAP_S,
    MAX_UNVERIFIED_PUSHES,
    OPENINGS_PER_CALLER,
    POLLS_PER_CALLER,
    POLLS_PER_WORKER,
    long_poll_wait_s,
    max_concurrent_rpcs,
    opening_slots,
    push_limits,
)
from disttrain.strategies.ps.server.members import (
    FencedPush,
    IdentityTaken,
    SessionRefused,
    UnknownGeneration,
    UnknownWorker,
)
from disttrain.strategies.ps.server.shard import ShardState, ShardStopping, WorkerClaim, WorkersNotDone
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.codec import Payload

logger = logging.getLogger(__name__)

# The first matching class decides: subclasses before the ValueError they derive from.
CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NotPermitted, grpc.StatusCode.PERMISSION_DENIED),  # another worker's call, or not a worker's
    (SessionRefused, grpc.StatusCode.PERMISSION_DENIED),
    (IdentityTaken, grpc.StatusCode.ALREADY_EXISTS),
    (UnknownGeneration, grpc.StatusCode.UNAVAILABLE),  # the membership is on its way: retry
    (ShardStopping, grpc.StatusCode.UNAVAILABLE),
    (TooManyBarriers, grpc.StatusCode.RESOURCE_EXHAUSTED),  # the worker's share of the barriers
    (WorkersNotDone, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownWorker, grpc.StatusCode.FAILED_PRECONDITION),
    (FencedPush, grpc.StatusCode.FAILED_PRECONDITION),
    (PushRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # a malformed message (InvalidPush, InvalidIdentity)
)

Outcome = pb.PushReply.Outcome
# Sync outcomes after which the worker's step is the version its push joined.
_JOINED = {Outcome.Value("APPLIED"), Outcome.Value("BUFFERED"), Outcome.Value("DUPLICATE")}
_ROLLED_BACK = Outcome.Value("ROLLED_BACK")
# The slots of a caller's streams whose first message has not come: no worker is known yet.
_OPENING = "(streams awaiting their first message)"
# The slots of a caller's waits for every worker to be done, made for no worker.
_OBSERVERS = "(observing until all done)"
# The share of every caller the server cannot tell apart (the operator, or anyone on a
# server without credentials): trusted, bounded by the totals alone.
_TRUSTED = "the trusted callers"


def call_owner(context) -> str | None:
    """The share a call is made under: the node its credentials name (None: a trusted
    caller, see `caller_key`), as the authorization table's check found it."""
    grant = getattr(context, GRANT_ATTRIBUTE, None)
    return caller_key(grant.caller if grant is not None else None)


class ParameterServicer:
    """gRPC handlers of one shard; every method maps to one `ShardState` call.

    Every long-poll takes one of `polls` before it waits (RESOURCE_EXHAUSTED when none is
    left) and waits at most `wait_cap_s`, whatever its client's deadline.
    """

    def __init__(self, state: ShardState, stopped: threading.Event, polls: PollSlots,
                 wait_cap_s: float = LONG_POLL_CAP_S, first_message_s: float = FIRST_MESSAGE_S):
        self.state = state
        self.first_message_s = first_message_s
        self.max_opening = opening_slots(polls.max_total)
        # what all callers' streams awaiting their first message hold together, each
        # caller's few among them
        self.openings = PollSlots(self.max_opening, OPENINGS_PER_CALLER)
        self.stopped = stopped
        self.polls = polls
        self.wait_cap_s = wait_cap_s
        self.push_limits = push_limits(state.plan.nbytes, state.decoder.compressed_nbytes,
                                       len(state.plan.slices))
        self.deadlines = Deadlines()
        self.refused_log = RefusalLog()  # an outsider's refused calls must not flood the log

    def refusals(self, context):
        """Answer a refusal raised in the block with its status code (`CODES`) and
        message, and log it (rate-limited: an outsider's calls must not flood the log)."""
        return rpc_refusals(context, CODES, self.refused_log.of(call_owner(context)))

    def authorized(self, context, header: pb.GradientMessage) -> None:
        """Refuse (PERMISSION_DENIED) a push whose header its caller may not send (another
        worker's, or not a worker's: the authorization table, `core.access`); before
        anything else of it is read. The table checks every other call before its
        method runs."""
        with self.refusals(context):
            authorize_message(context, header)

    def long_poll(self, key: str, context, per_key: int | None = None):
        """The slot one long-poll of `key` holds while it waits, under its caller's share;
        aborts (RESOURCE_EXHAUSTED) when the key, the caller or the server has none left."""
        try:
            return self.polls.take(key, per_key, owner=call_owner(context))
        except PollLimitExceeded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    def opening(self, context) -> ExitStack:
        """The slots a stream awaiting its first message holds: one of its caller's opening
        slots (the trusted share them all) and a long-poll slot of its caller."""
        owner = call_owner(context)
        key = f"{owner or _TRUSTED} {_OPENING}"
        with ExitStack() as stack:  # on a refusal, what was taken is let go
            try:
                stack.enter_context(self.openings.take(key, None if owner else self.max_opening))
            except PollLimitExceeded as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            stack.enter_context(self.long_poll(key, context, self.max_opening))
            return stack.pop_all()

    def first_message(self, requests, context):
        """The next message of a stream that has shown no worker yet (None: it ended, or
        was cancelled), waited for on one of its caller's opening slots and within
        `first_message_s`; the call is cancelled when it does not come in time."""
        with self.opening(context), self.deadlines.limit(context, self.first_message_s):
            try:
                return next(requests, None)
            except grpc.RpcError:  # cancelled: by the deadline, or the client went away
                return None

    def wait_s(self, context) -> float:
        return long_poll_wait_s(context.time_remaining(), self.wait_cap_s)

    # -- pushes ---------------------------------------------------------------------------

    def SendGradients(self, request_iterator, context):
        with self.deadlines.limit(context, self.push_limits.max_read_s):
            payload = self.collect(iter(request_iterator), context, stream=True)
        return self.held(payload, self.push(payload, context), context)

    def PushGradients(self, raw, context):
        payload = self.collect(iter([raw]), context)
        return self.held(payload, self.push(payload, context), context)

    def held(self, payload: Payload | None, reply: pb.PushReply, context) -> pb.PushReply:
        """`reply`, once its worker may go on (SSP by steps: see `step_allowed`), waited
        for on one of the worker's long-poll slots."""
        if payload is not None and self._bounded(payload.header, reply):
            with self.long_poll(f"{payload.header.worker_id} (push)", context):
                self._wait_to_go_on(payload.header, context)
        return reply

    def _bounded(self, header: pb.GradientMessage, reply: pb.PushReply) -> bool:
        """Whether the reply to the push of `header` waits for the slowest worker."""
        return self.state.rules.bounds_steps and not header.redo and reply.outcome != _ROLLED_BACK

    def _wait_to_go_on(self, header: pb.GradientMessage, context) -> None:
        """Wait until the worker of `header` may compute its next step; the call ends
        (DEADLINE_EXCEEDED, UNAVAILABLE when stopping) when it may not in time."""
        state = self.state
        allowed = state.step_allowed(header.worker_id, header.step, header.epoch, self.wait_s(context))
        if not allowed:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if allowed is False else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"worker {printable(header.worker_id[:64])} at step {header.step} is still "
                                f"more than the SSP bound ahead on shard {state.plan.shard} "
                                f"({state.holding_back(header.epoch)}); push again to wait on")

    def collect(self, raws, context, stream: bool = False) -> Payload | None:
        """The push's frames, decoded here (not on gRPC's polling thread) within the
        shard's bounds; the stream stops being read at the first frame over one, and is
        read on only for a worker's own session, on one of its slots. None: a push of an
        earlier incarnation of this server, its first frame read alone."""
        limits = self.push_limits
        try:
            raw = self.first_message(raws, context) if stream else next(raws, None)
            if raw is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: no message arrived")
            first = service.read_gradient(raw, limits.max_fields)
            header = first.header
            self.authorized(context, header)
            if header.incarnation not in (0, self.state.incarnation):
                return None  # answered ROLLED_BACK: the worker registers again
            with self.refusals(context):
                self.state.identities.check(header.worker_id, header.session)
            frames = (service.read_gradient(raw, limits.max_fields) for raw in raws)
            with self.long_poll(f"{header.worker_id} (push)", context) if stream else nullcontext():
                return service.collect_payload(itertools.chain([first], frames), limits.max_bytes,
                                               limits.max_frames, require_data=True)
        except ValueError as e:  # a malformed frame, or over a bound
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except grpc.RpcError:  # cancelled: the client went away, or the push took too long
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the push did not arrive whole within {limits.max_read_s:.0f}s")

    def push(self, payload: Payload | None, context) -> pb.PushReply:
        if payload is None:  # of an earlier incarnation of this server
            return pb.PushReply(outcome=_ROLLED_BACK, version=self.state.version,
                                incarnation=self.state.incarnation)
        with self.refusals(context):
            decision = self.state.push(payload)
        return pb.PushReply(outcome=decision.outcome.value, version=decision.version,
                            staleness=decision.staleness, incarnation=self.state.incarnation,
                            learning_rate=decision.learning_rate)

    def Step(self, request_iterator, context):
        """The replies of one Step stream, one per push, until the worker closes it."""
        state = self.state
        if not service.fits_one_message(state.plan.nbytes) and not state.segments:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {state.plan.shard} holds {state.plan.nbytes} bytes, more than one "
                          "message carries; push with SendGradients and pull with GetParameters")
        requests, unverified = iter(request_iterator), 0
        with ExitStack() as slot:
            holding = False
            while (raw := next(requests, None) if holding else self.first_message(requests, context)) \
                    is not None:
                payload = self.collect(iter([raw]), context)
                reply = self.push(payload, context)
                if reply.outcome == _ROLLED_BACK:  # read nothing: the worker registers again first
                    unverified = 0 if holding else unverified + 1
                    if unverified > MAX_UNVERIFIED_PUSHES:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{unverified} pushes of an earlier incarnation of this server in a "
                                      "row; register again, then push")
                    yield service.step_answer(reply)
                    continue
                if not holding:  # the first push that passed the session check
                    slot.enter_context(self.long_poll(f"{payload.header.worker_id} (step)", context))
                    holding = True
                yield service.step_answer(reply, self._parameters_after(payload.header, reply, context))

    def _parameters_after(self, header: pb.GradientMessage, reply: pb.PushReply, context) -> bytes:
        """The parameter message that follows `reply` to the push of `header`: in sync
        mode the result of the step the push joined."""
        wanted = 0
        if self._bounded(header, reply):
            self._wait_to_go_on(header, context)
        if self.state.rules.mode == "sync" and reply.outcome in _JOINED:
            wanted = self.state.step_applied(header.worker_id, self.wait_s(context))
            if wanted is None:
                state = self.state
                code = grpc.StatusCode.UNAVAILABLE if state.stopping else grpc.StatusCode.DEADLINE_EXCEEDED
                context.abort(code, f"shard {state.plan.shard} did not apply the step of this push in time "
                                    f"(now at version {state.version})")
        return self._parameters(header.worker_id, wanted, header.shared_memory, context,
                                header.holds_version)[0]

    # -- pulls ----------------------------------------------------------------------------

    def GetParameters(self, request, context):
        yield from self._pull(request, context)

    def FetchParameters(self, request, context):
        if not request.shared_memory and not service.fits_one_message(self.state.plan.nbytes):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {self.state.plan.shard} holds {self.state.plan.nbytes} bytes, more "
                          "than one message carries; use GetParameters")
        (message,) = self._pull(request, context)
        return message

    def _pull(self, request, context) -> list[bytes]:
        """The messages that answer a pull, once the version is there: only the worker's
        own session may wait, on one of its long-poll slots."""
        state = self.state
        if request.shard != state.plan.shard:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"pull for shard {request.shard} reached shard {state.plan.shard}")
        if request.incarnation not in (0, state.incarnation):  # it must register again first
            stamp = service.ParameterStamp(state.version, state.incarnation)
            return [service.parameter_notice(state.plan, stamp)]
        with self.refusals(context):
            state.identities.check(request.worker_id, request.session)
        with self.long_poll(request.worker_id, context):
            return self._parameters(request.worker_id, request.min_version, request.shared_memory, context)

    def _parameters(self, worker_id: str, version: int, shared_memory: bool, context,
                    holds_version: int = 0) -> list[bytes]:
        """The messages of the parameters once at `version`: through the worker's segment
        (one notice) or as frames (under pull compression, the changes alone for a worker
        whose `holds_version`, 1 + the version it holds, the shard kept them from); the call
        ends when the version does not come in time."""
        state, timeout = self.state, self.wait_s(context)
        if shared_memory:
            with self.refusals(context):
                notice = state.write_parameters(worker_id, version, timeout)
            if notice is not None:
                return [notice]
        else:
            frames = state.wait_for_version(version, timeout, holds_version - 1)
            if frames is not None:
                return frames
        code = grpc.StatusCode.UNAVAILABLE if state.stopping else grpc.StatusCode.DEADLINE_EXCEEDED
        context.abort(code, f"shard {state.plan.shard} did not reach version {version} in time "
                            f"(now {state.version})")

    # -- membership and control -----------------------------------------------------------

    def RegisterWorker(self, request, context):
        """Register the worker; shared-memory segments only for a peer on this host: a
        remote worker could never map them, and would leave them in /dev/shm until the
        shard stops."""
        state, peer = self.state, context.peer()
        local = request.shared_memory and peer_is_local(peer)
        with self.refusals(context):
            joined = state.register(WorkerClaim(request.worker_id, request.key, request.generation),
                                    request.requested_rank, shared_memory=local,
                                    epochs_done=request.epochs_done, sync_step=request.sync_step)
        plan, rules = state.plan, state.rules
        logger.info("worker %s (%s pid %d, from %s) registered as rank %d", request.worker_id,
                    printable(request.hostname[:64]), request.pid, peer, joined.rank)
        assignment = pb.WorkerAssignment(
            rank=joined.rank, world_size=rules.world_size, worker_id=request.worker_id, shard=plan.shard,
            num_shards=plan.num_shards, aggregation_mode=rules.mode, staleness=rules.staleness_bound,
            version=joined.version, layout=service.slice_specs(plan), dtype=plan.dtype,
            incarnation=state.incarnation, session=joined.session)
        if joined.segments is not None:
            assignment.shared_memory.gradient_path = str(joined.segments.gradient.path)
            assignment.shared_memory.parameter_path = str(joined.segments.parameter.path)
            assignment.shared_memory.nonce = joined.segments.gradient.nonce
        return assignment

    def WorkerDone(self, request, context):
        with self.refusals(context):
            self.state.worker_done(request.worker_id, request.session)
        return pb.ShardStatus(**self.state.status())

    def GetStatus(self, request, context):
        """The shard's counters; with `wait_all_done`, once every worker is done: a
        worker's wait (with its session, checked) on one of its own slots, an observer's
        (no session) on its caller's own observing slots, never a worker's."""
        if request.wait_all_done:
            key = f"{call_owner(context) or _TRUSTED} {_OBSERVERS}"
            if request.session:
                with self.refusals(context):
                    self.state.identities.check(request.worker_id, request.session)
                key = f"{request.worker_id} (all done)"
            with self.long_poll(key, context):
                self.state.wait_all_done(self.wait_s(context))
        return pb.ShardStatus(**self.state.status())

    def Barrier(self, request, context):
        with self.refusals(context):  # before a slot is taken in its name
            self.state.identities.check(request.worker_id, request.session)
        with self.refusals(context), self.long_poll(request.worker_id, context):
            rows = self.state.barrier(request.worker_id, request.session, request.name, list(request.values),
                                      self.wait_s(context), request.step)
        if rows == []:
            return pb.BarrierReply(world_size=0, given_up=True)
        if rows is None:
            code = grpc.StatusCode.UNAVAILABLE if self.state.stopping else grpc.StatusCode.DEADLINE_EXCEEDED
            context.abort(code, f"not every worker reached barrier {request.name!r} in time")
        return pb.BarrierReply(world_size=len(rows), values=[v for row in rows for v in row])

    def GetLedger(self, request, context):
        with self.refusals(context):
            self.state.identities.check(request.worker_id, request.session)
        return pb.LedgerReply(block_ids=self.state.ledger(request.first_block, request.end_block))

    def Shutdown(self, request, context):
        """Stop the shard at the run's end: only the worker that writes the final model
        (the lowest rank not reassigned) may, with its session, once every worker is done.
        Anyone else (another worker, an outsider with the run's token) is refused, so the
        shard is never stopped before that worker's final pull; an operator stops a
        shard with SIGTERM."""
        with self.refusals(context):
            self.state.check_finisher(request.worker_id, request.session)
        self.stopped.set()
        return pb.ShardStatus(**self.state.status())


def _handler(servicer: ParameterServicer) -> grpc.GenericRpcHandler:
    handlers = {}
    for name, (kind, request_type, response_type) in service.METHODS.items():
        # Framed requests are decoded by the handler: gRPC runs deserializers on its polling thread.
        behavior = getattr(servicer, name)
        if request_type is None:
            deserialize = service.identity
        else:
            deserialize = _bounded_parser(request_type, service.REQUEST_MAX_BYTES[name])
            behavior = _refusing_oversize(behavior, name)
        serialize = service.identity if response_type is None else response_type.SerializeToString
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[name] = make(behavior, request_deserializer=deserialize, response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service.SERVICE, handlers)


class _Oversize(Unread):
    """A request over its method's size limit, left unparsed (the handler refuses it)."""

    def __init__(self, nbytes: int, limit: int):
        self.nbytes, self.limit = nbytes, limit


def _bounded_parser(request_type, limit: int):
    def parse(data: bytes):
        return _Oversize(len(data), limit) if len(data) > limit else request_type.FromString(data)
    return parse


def _refusing_oversize(behavior, name: str):
    def handle(request, context):
        if isinstance(request, _Oversize):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"a {name} request of {request.nbytes} bytes; at most {request.limit}")
        return behavior(request, context)
    return handle


class ShardServer:
    """A started gRPC server for one shard. `address` is what it bound ("host:port").

    Long-polls wait at most `long_poll_cap_s` each and never hold more than the pool's
    `max_threads` less a reserve (see `limits`), so calls that answer at once always run.
    """

    def __init__(self, state: ShardState, bind: str, max_threads: int = 32,
                 credentials: Credentials | None = None, long_poll_cap_s: float = LONG_POLL_CAP_S,
                 first_message_s: float = FIRST_MESSAGE_S):
        self.state = state
        self.stopped = threading.Event()
        self.polls = PollSlots.for_pool(max_threads, POLLS_PER_WORKER, POLLS_PER_CALLER)
        self.servicer = servicer = ParameterServicer(state, self.stopped, self.polls, long_poll_cap_s,
                                                     first_message_s)
        limits = ServerLimits(max_threads, max_concurrent_rpcs(max_threads), tuple(service.CHANNEL_OPTIONS))
        self._server = RpcServer(_handler(servicer), service.SERVICE, bind, limits, credentials)
        self.address = self._server.address

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving, wake waiters and write the final checkpoint."""
        self.state.stop()
        self._server.stop(grace_s)
