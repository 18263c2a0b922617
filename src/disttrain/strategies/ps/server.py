"""One parameter-server shard, served over gRPC (the `ps-server` role).

A thin servicer: it decodes requests, calls `ShardState`, and maps failures to status
codes (INVALID_ARGUMENT for malformed pushes, FAILED_PRECONDITION for protocol
violations). The server binds `--bind HOST:PORT` (port 0 picks a free one), reports the
address it bound on its log and, under the cluster launcher, as an event line on stdout,
and stops on SIGTERM/SIGINT or on a Shutdown call once every worker is done, writing a
final checkpoint.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import threading
from contextlib import nullcontext
from pathlib import Path

import grpc
from torch.nn.utils import parameters_to_vector

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core.deadlines import Deadlines
from disttrain.core.faults import FaultInjector
from disttrain.core.poll_slots import PollLimitExceeded, PollSlots
from disttrain.core.processes import bind_to_parent, emit_event
from disttrain.core.rpc_server import RpcServer
from disttrain.core.tls import TlsFiles
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import registration, steps, wire
from disttrain.strategies.ps.codec import Payload
from disttrain.strategies.ps.limits import (
    LONG_POLL_CAP_S,
    POLLS_PER_WORKER,
    long_poll_wait_s,
    push_limits,
)
from disttrain.strategies.ps.link import join
from disttrain.strategies.ps.model import check_supported
from disttrain.strategies.ps.refusals import refusals
from disttrain.strategies.ps.shard import ShardState
from disttrain.strategies.ps.sharding import plan_shards
from disttrain.training.engine import configure_threads
from disttrain.training.models import init_model

logger = logging.getLogger(__name__)


class ParameterServicer:
    """gRPC handlers of one shard; every method maps to one `ShardState` call.

    Every long-poll takes one of `polls` before it waits (RESOURCE_EXHAUSTED when none is
    left) and waits at most `wait_cap_s`, whatever its client's deadline.
    """

    def __init__(self, state: ShardState, stopped: threading.Event, polls: PollSlots,
                 wait_cap_s: float = LONG_POLL_CAP_S):
        self.state = state
        self.stopped = stopped
        self.polls = polls
        self.wait_cap_s = wait_cap_s
        self.push_limits = push_limits(state.plan.nbytes, state.decoder.compressed_nbytes,
                                       len(state.plan.slices))
        self.deadlines = Deadlines()

    def long_poll(self, key: str, context):
        """The slot one long-poll of `key` holds while it waits; aborts when none is left."""
        try:
            return self.polls.take(key)
        except PollLimitExceeded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    def wait_s(self, context) -> float:
        return long_poll_wait_s(context.time_remaining(), self.wait_cap_s)

    def SendGradients(self, request_iterator, context):
        with self.deadlines.limit(context, self.push_limits.max_read_s):
            payload = self.collect(request_iterator, context, stream=True)
        return self.push(payload, context)

    def PushGradients(self, raw, context):
        return self.push(self.collect(iter([raw]), context), context)

    def collect(self, raws, context, stream: bool = False) -> Payload:
        """The push's frames, decoded here (not on gRPC's polling thread) within the
        shard's bounds; the stream stops being read at the first frame over one, and is
        read on only for a worker's own session, on one of its slots."""
        limits = self.push_limits
        frames = (wire.read_gradient(raw, limits.max_fields) for raw in raws)
        try:
            first = next(frames, None)
            if first is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: no message arrived")
            header = first.header
            if header.incarnation in (0, self.state.incarnation):  # else: answered ROLLED_BACK unread
                with refusals(context):
                    self.state.identities.check(header.worker_id, header.session)
            with self.long_poll(f"{header.worker_id} (push)", context) if stream else nullcontext():
                return wire.collect_payload(itertools.chain([first], frames), limits.max_bytes,
                                            limits.max_frames, require_data=True)
        except ValueError as e:  # a malformed frame, or over a bound
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except grpc.RpcError:  # cancelled: the client went away, or the push took too long
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the push did not arrive whole within {limits.max_read_s:.0f}s")

    def push(self, payload: Payload, context) -> pb.PushReply:
        with refusals(context):
            decision = self.state.push(payload)
        return pb.PushReply(outcome=decision.outcome.value, version=decision.version,
                            staleness=decision.staleness, incarnation=self.state.incarnation)

    def Step(self, request_iterator, context):
        yield from steps.answer(self, request_iterator, context)

    def GetParameters(self, request, context):
        yield from self._pull(request, context)

    def FetchParameters(self, request, context):
        if not request.shared_memory and not wire.fits_one_message(self.state.plan.nbytes):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {self.state.plan.shard} holds {self.state.plan.nbytes} bytes, more "
                          "than one message carries; use GetParameters")
        (message,) = self._pull(request, context)
        return message

    def _pull(self, request, context) -> list[bytes]:
        """The messages that answer a pull, once the version is there: only the worker's
        own session may wait, on one of its long-poll slots."""
        if request.shard != self.state.plan.shard:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"pull for shard {request.shard} reached shard {self.state.plan.shard}")
        if request.incarnation not in (0, self.state.incarnation):  # it must register again first
            return [wire.parameter_notice(self.state.plan, self.state.version, self.state.incarnation)]
        with refusals(context):
            self.state.identities.check(request.worker_id, request.session)
        with self.long_poll(request.worker_id, context):
            timeout = self.wait_s(context)
            if request.shared_memory:
                with refusals(context):
                    version = self.state.write_parameters(request.worker_id, request.min_version, timeout)
                if version is not None:
                    return [wire.parameter_notice(self.state.plan, version, self.state.incarnation)]
            else:
                snapshot = self.state.wait_for_version(request.min_version, timeout)
                if snapshot is not None:
                    return snapshot.frames
        self.not_reached(context, request.min_version)

    def not_reached(self, context, version: int) -> None:
        """End a call whose wait for `version` timed out (or was cut short by a stop)."""
        code = grpc.StatusCode.UNAVAILABLE if self.state.stopping else grpc.StatusCode.DEADLINE_EXCEEDED
        context.abort(code, f"shard {self.state.plan.shard} did not reach version {version} in time "
                            f"(now {self.state.version})")

    def RegisterWorker(self, request, context):
        with refusals(context):
            return registration.admit(self.state, request, context.peer())

    def WorkerDone(self, request, context):
        with refusals(context):
            self.state.worker_done(request.worker_id, request.session)
        return pb.ShardStatus(**self.state.status())

    def GetStatus(self, request, context):
        if request.wait_all_done:
            with self.long_poll("GetStatus(wait_all_done)", context):
                self.state.wait_all_done(self.wait_s(context))
        return pb.ShardStatus(**self.state.status())

    def Barrier(self, request, context):
        with refusals(context), self.long_poll(request.worker_id, context):
            rows = self.state.barrier(request.worker_id, request.session, request.name, list(request.values),
                                      self.wait_s(context), request.step)
        if rows == []:
            return pb.BarrierReply(world_size=0, given_up=True)
        if rows is None:
            code = grpc.StatusCode.UNAVAILABLE if self.state.stopping else grpc.StatusCode.DEADLINE_EXCEEDED
            context.abort(code, f"not every worker reached barrier {request.name!r} in time")
        return pb.BarrierReply(world_size=len(rows), values=[v for row in rows for v in row])

    def GetLedger(self, request, context):
        return pb.LedgerReply(block_ids=self.state.ledger(request.first_block, request.end_block))

    def Shutdown(self, request, context):
        if not self.state.rules.all_done():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "workers are still training; shut down after every worker is done")
        self.stopped.set()
        return pb.ShardStatus(**self.state.status())


def _handler(servicer: ParameterServicer) -> grpc.GenericRpcHandler:
    handlers = {}
    for name, (kind, request_type, response_type) in wire.METHODS.items():
        # Framed requests are decoded by the handler: gRPC runs deserializers on its polling thread.
        deserialize = wire.identity if request_type is None else request_type.FromString
        serialize = wire.identity if response_type is None else response_type.SerializeToString
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[name] = make(getattr(servicer, name), request_deserializer=deserialize,
                              response_serializer=serialize)
    return grpc.method_handlers_generic_handler(wire.SERVICE, handlers)


class ShardServer:
    """A started gRPC server for one shard. `address` is what it bound ("host:port").

    Long-polls wait at most `long_poll_cap_s` each and never hold more than the pool's
    `max_threads` less a reserve (see `limits`), so calls that answer at once always run.
    """

    def __init__(self, state: ShardState, bind: str, max_threads: int = 32, token: str | None = None,
                 long_poll_cap_s: float = LONG_POLL_CAP_S, tls: TlsFiles | None = None):
        self.state = state
        self.stopped = threading.Event()
        self.polls = PollSlots.for_pool(max_threads, POLLS_PER_WORKER)
        self.servicer = servicer = ParameterServicer(state, self.stopped, self.polls, long_poll_cap_s)
        self._server = RpcServer(_handler(servicer), wire.SERVICE, bind,
                                 max_threads, options=wire.CHANNEL_OPTIONS, token=token, tls=tls)
        self.address = self._server.address

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving, wake waiters and write the final checkpoint."""
        self.state.stop()
        self._server.stop(grace_s)


def build_state(config: Config, shard: int, num_shards: int, resume: bool = False) -> ShardState:
    """The state of shard `shard` of `num_shards`: the model's initial slice (from the
    training seed), restored from this shard's newest checkpoint when resuming.

    Raises:
        ConfigError: the checkpoint dir holds an earlier run (and not resuming).
        CheckpointError: the newest checkpoint cannot be used.
    """
    model = init_model(config.training)
    plan = plan_shards(model, num_shards)[shard]
    flat = parameters_to_vector(model.parameters())[plan.offset:plan.offset + plan.numel]
    folder = Path(config.system.checkpoint_dir) / f"server{shard}"
    resumed_from = ckpt.prepare_checkpoint_dir(folder, resume)
    state = ShardState(plan, flat, config, folder)
    if resumed_from is not None:
        state.restore(resumed_from)
    return state


def serve(config: Config, bind: str, shard: int, num_shards: int, resume: bool = False,
          faults: FaultInjector | None = None, token: str | None = None,
          tls: TlsFiles | None = None) -> None:
    """Run one shard until SIGTERM/SIGINT or a Shutdown call; with a coordinator in the
    config, registered with it, heartbeating, and following its membership. With a
    `token`, calls without it are refused (but health checks), and it is sent to the coordinator.
    With `tls`, it listens with TLS and reaches the coordinator with the same files.

    Raises:
        ConfigError: the address cannot be bound, or the checkpoint dir holds an earlier run.
        CheckpointError: the newest checkpoint cannot be used (with `resume`).
    """
    check_supported(config)
    bind_to_parent()
    wire.tune_allocator()
    configure_threads(config.system.num_threads or 1)
    state = build_state(config, shard, num_shards, resume)
    # Long-polls hold a thread each: room for every worker's push, pull and status call.
    server = ShardServer(state, bind, max_threads=max(32, 4 * config.system.num_workers + 8), token=token,
                         tls=tls)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stopped.set())
    logger.info("shard %d/%d (%d parameters, %.2f MB) listening on %s (%s)", shard, num_shards,
                state.plan.numel, state.plan.nbytes / 1e6, server.address, socket.gethostname())
    if faults is not None:
        state.on_version = faults.at_step
    emit_event("listening", address=server.address, shard=shard)
    link = join(config.coordinator, f"server{shard}", "server", shard,
                lambda: (0, state.version, 0), server.address, state.set_membership, token=token, tls=tls)
    try:
        server.stopped.wait()
    finally:
        server.stop()
        if link is not None:
            link.leave()
        logger.info("shard %d stopped at version %d", shard, state.version)
