"""The coordinator on the wire: a thin gRPC shell around the membership rules.

`CoordinatorState` holds the membership behind one lock, persists every membership
change, event and recovery to the registry at once (progress from heartbeats and metrics
reports at the next monitor tick), and wakes the WatchMembership long-polls.
`CoordinatorServer` serves it and runs the monitor thread that declares silent nodes
failed. The coordinator never calls out.

What callers share is shared per caller (the node its credentials name): each holds at
most `WATCHES_PER_CALLER` membership watches (a node watches once, and a retry's
abandoned attempt may still wait), all of them together leave a quarter of the handler
threads free, and refusals are logged per caller. A node registers in its own name only
(the authorization table), and with its own rank only (`Membership.register`: a rank
stays its first node's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator import limits
from disttrain.coordinator.client import METHODS, SERVICE
from disttrain.coordinator.membership import (
    DuplicateNode,
    Membership,
    NodeTableFull,
    UnknownNode,
    WrongProcess,
)
from disttrain.coordinator.nodes import ALIVE, Event, Node, Recovery
from disttrain.coordinator.registry import Registry, RegistryError
from disttrain.coordinator.reports import BalanceState, HeartbeatReport, NodeProcess
from disttrain.core.addresses import parse_address
from disttrain.core.credentials import Credentials
from disttrain.core.errors import ConfigError
from disttrain.core.identity import NotPermitted
from disttrain.core.poll_slots import PollLimitExceeded, PollSlots, caller_key
from disttrain.core.refusal_log import RefusalLog
from disttrain.core.rpc_access import GRANT_ATTRIBUTE
from disttrain.core.rpc_server import RpcServer, ServerLimits, refusals
from disttrain.proto import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

MAX_WAIT_S = 60.0  # longest WatchMembership hold, whatever the call's deadline
REPLY_MARGIN_S = 0.05  # a long-poll answers this long before its deadline, so the answer arrives
RECENT_EVENTS = 50
RECENT_RECOVERIES = 50
CAPABILITIES = [f.name for f in pb.Capabilities.DESCRIPTOR.fields]  # cpus, memory_bytes, gpu, gpu_count
# A status answer's nodes stop at this size: far under a client's 4 MB receive limit, with
# the events and recoveries (each bounded) beside them.
STATUS_BUDGET_BYTES = 1 << 20
# A node's membership watches at once: its watcher's, and a retry's whose abandoned
# attempt still waits. The trusted (the operator, any caller of a coordinator without
# credentials) share the totals alone.
WATCHES_PER_CALLER = 2


class CoordinatorState:
    """The membership, its persistence and its watchers. Thread-safe.

    Args:
        config: the `coordinator` config section.
        registry: where changes go; its content is loaded first (a restarted coordinator).
        clock: monotonic seconds (tests may pass a fake); `wall_clock`: seconds since the epoch.
    """

    def __init__(self, config: CoordinatorConfig, registry: Registry,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self.config = config
        self.registry = registry
        self.membership = Membership(config.heartbeat_timeout, config.straggler_factor,
                                     config.reassign_after, config.max_nodes)
        self.changed = threading.Condition()
        self.events: deque[Event] = deque(maxlen=RECENT_EVENTS)
        self.recoveries: deque[Recovery] = deque(maxlen=RECENT_RECOVERIES)
        self.max_step = 0
        self._clock, self._wall_clock = clock, wall_clock
        self._progress_unsaved = False
        self._saved_at = float("-inf")
        self._closed = False
        self._reload()

    def _offset(self) -> float:
        """Wall clock minus monotonic clock: turns one into the other."""
        return self._wall_clock() - self._clock()

    def _reload(self) -> None:
        snapshot = self.registry.load(RECENT_EVENTS, RECENT_RECOVERIES)
        self.membership.restore(snapshot.nodes, snapshot.generation, self._clock(), self._offset())
        self.events.extend(Event(**event) for event in snapshot.events)
        self.recoveries.extend(snapshot.recoveries)
        self.max_step = max((node["step"] for node in snapshot.nodes), default=0)
        if snapshot.nodes:
            logger.info("reloaded %d nodes (generation %d) from %s", len(snapshot.nodes),
                        snapshot.generation, self.registry.path)

    def opened(self) -> None:
        """The server listens: the reloaded nodes' heartbeat windows start now."""
        with self.changed:
            self.membership.opened(self._clock())

    def register(self, request: pb.RegisterNodeRequest) -> pb.RegisterNodeReply:
        """Raises ValueError (a field out of bounds, a bad role), DuplicateNode or
        NodeTableFull, changing nothing."""
        limits.check_registration(request)
        capabilities = {name: getattr(request.capabilities, name) for name in CAPABILITIES}
        with self.changed:
            node = self.membership.register(request.node_id, request.role, self._clock(), request.rank,
                                            request.address,
                                            NodeProcess(request.pid, request.hostname, capabilities))
            self._save()
            return pb.RegisterNodeReply(generation=node.joined_generation, restarts=node.restarts,
                                        heartbeat_interval_s=self.config.heartbeat_interval,
                                        heartbeat_timeout_s=self.config.heartbeat_timeout,
                                        run_finished=self.membership.run_finished)

    def heartbeat(self, request: pb.HeartbeatMessage) -> pb.HeartbeatReply:
        """Raises UnknownNode (a node never registered), ValueError (a figure negative or not
        finite, no pid) or WrongProcess (another pid holds the id), changing nothing."""
        limits.check_heartbeat(request)
        balance = BalanceState(request.batch_size, request.warmup_speed, request.plans)
        with self.changed:
            report = HeartbeatReport(request.epoch, request.step, request.throughput, request.step_time_s,
                                     balance)
            alive = self.membership.heartbeat(request.node_id, self._clock(), request.pid, report)
            self.max_step = max(self.max_step, request.step)
            self._progress_unsaved = True
            if self.membership.has_events:  # a recovery or a re-plan: persist it now, progress can wait
                self._save()
            return pb.HeartbeatReply(alive=alive, generation=self.membership.generation)

    def report_metrics(self, request: pb.MetricsReport) -> pb.MetricsReply:
        """Keep the node's latest metrics (written with the next progress save). Raises
        UnknownNode (a node never registered) or ValueError (bad values), changing nothing."""
        limits.check_metrics(request)
        with self.changed:
            self.membership.report_metrics(request.node_id, request.step, dict(request.scalars))
            self._progress_unsaved = True
            return pb.MetricsReply()

    def exited(self, request: pb.ExitReport) -> pb.ExitReply:
        """Raises ValueError (a field out of bounds, no pid or generation) or WrongProcess
        (not the node's current pid and generation), changing nothing."""
        limits.check_exit(request)
        if request.pid <= 0 or request.generation <= 0:
            raise ValueError("an exit report names the pid and generation the node registered with "
                             f"(pid {request.pid}, generation {request.generation} given)")
        with self.changed:
            known = self.membership.exited(request.node_id, request.exit_code, request.reason, self._clock(),
                                           request.pid, request.generation)
            self._save()
            return pb.ExitReply(known=known, generation=self.membership.generation)

    def check(self) -> list[Event]:
        """Declare silent nodes failed, flag stragglers, persist. Returns the new events."""
        with self.changed:
            now = self._clock()
            found = self.membership.check(now)
            # Progress alone is written at most once per heartbeat interval.
            progress_due = self._progress_unsaved and now - self._saved_at >= self.config.heartbeat_interval
            if found or progress_due:
                self._save()
            return found

    def watch(self, after_generation: int, wait_s: float) -> pb.Membership:
        """The membership once its generation differs from `after_generation` (a watcher
        ahead of us saw a coordinator that lost its registry), or after `wait_s`."""
        with self.changed:
            self.changed.wait_for(lambda: self._closed or self.membership.generation != after_generation,
                                  timeout=max(0.0, wait_s))
            members = [pb.Member(node_id=n.node_id, role=n.role, rank=n.rank, state=n.state,
                                 joined_generation=n.joined_generation, address=n.address)
                       for n in self.membership.members()]
            return pb.Membership(generation=self.membership.generation, members=members)

    def status(self) -> pb.ClusterStatus:
        """Every node that fits `STATUS_BUDGET_BYTES` (live ones first, then the most recently
        heard), by role, rank and id; the latest events and recoveries."""
        with self.changed:
            now = self._clock()
            nodes, size = [], 0
            for node in sorted(self.membership.members(),
                               key=lambda n: (n.state != ALIVE, -(n.last_seen or float("-inf")))):
                status = _node_status(node, now)
                size += status.ByteSize() + 8  # and its tag and length
                if size > STATUS_BUDGET_BYTES:
                    break
                nodes.append(status)
            omitted = len(self.membership.members()) - len(nodes)
            nodes.sort(key=lambda n: (n.role, n.rank, n.node_id))
            events = [pb.ClusterEvent(time=e.time, node_id=e.node_id, kind=e.kind, detail=e.detail,
                                      generation=e.generation) for e in self.events]
            recoveries = [pb.Recovery(**vars(r)) for r in self.recoveries]
            return pb.ClusterStatus(generation=self.membership.generation, nodes=nodes, events=events,
                                    recoveries=recoveries, omitted_nodes=omitted)

    def close(self) -> None:
        """Persist what is left and release every long-poll."""
        with self.changed:
            self._closed = True
            self._save()
            self.changed.notify_all()

    def _save(self) -> None:
        """Write the nodes changed (and drop those forgotten), the new events and recoveries
        (call with the lock held); wake watchers."""
        events = self.membership.take_events(self._offset())
        recoveries = self.membership.take_recoveries(self._offset())
        for event in events:
            log = logger.warning if event.kind in ("failed", "reassigned") else logger.info
            log("%s %s (generation %d): %s", event.node_id, event.kind, event.generation, event.detail)
        self.events.extend(events)
        self.recoveries.extend(recoveries)
        self.changed.notify_all()
        try:
            rows, forgotten = self.membership.changes(self._offset())
            self.registry.save(rows, [vars(e) for e in events], self.membership.generation, recoveries,
                               forgotten)
            self.membership.changes_saved()
            self._progress_unsaved, self._saved_at = False, self._clock()
        except RegistryError as e:
            logger.error("the registry was not updated (%s); serving on from memory", e)


def _node_status(node: Node, now: float) -> pb.NodeStatus:
    capabilities = pb.Capabilities(**node.capabilities)
    age = -1.0 if node.last_heartbeat is None else max(0.0, now - node.last_heartbeat)
    return pb.NodeStatus(node_id=node.node_id, role=node.role, rank=node.rank, address=node.address,
                         hostname=node.hostname, pid=node.pid, capabilities=capabilities, state=node.state,
                         heartbeat_age_s=age, restarts=node.restarts, epoch=node.epoch, step=node.step,
                         throughput=node.throughput, step_time_s=node.step_time_s, straggler=node.straggler,
                         batch_size=node.batch_size, warmup_speed=node.warmup_speed, plans=node.plans,
                         metrics=node.metrics, metrics_step=node.metrics_step,
                         joined_generation=node.joined_generation)


# What each refusal is answered with; a refused call changes nothing.
CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NotPermitted, grpc.StatusCode.PERMISSION_DENIED),  # another node's call, or not its role's
    (UnknownNode, grpc.StatusCode.NOT_FOUND),  # register first
    (DuplicateNode, grpc.StatusCode.ALREADY_EXISTS),
    (WrongProcess, grpc.StatusCode.FAILED_PRECONDITION),  # not the node's current process
    (NodeTableFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # a malformed message
)


class CoordinatorServicer:
    """gRPC methods: translate messages and errors; the decisions are the membership's.
    Refusals are logged at most once per caller per `RefusalLog` period, with a count."""

    def __init__(self, state: CoordinatorState, on_step: Callable[[int], None] | None = None,
                 watches: PollSlots | None = None, refusal_log: RefusalLog | None = None):
        self.state = state
        self.on_step = on_step
        self.watches = watches or watch_slots(128)
        self.refusal_log = refusal_log or RefusalLog()

    def _log(self, context):
        """The refusal log as seen by this call's caller (its refusals counted as its own)."""
        return self.refusal_log.of(_owner(context))

    # Who may make each call, in whose name, is the authorization table's (`core.access`),
    # checked before a method runs: a node registers, heartbeats and reports in its own
    # name only; the end of a node is told by the node, its launcher (the operator) or a
    # coordinator.

    def RegisterNode(self, request, context):
        with refusals(context, CODES, self._log(context), "RegisterNode"):
            return self.state.register(request)

    def SendHeartbeat(self, request, context):
        with refusals(context, CODES, self._log(context), "SendHeartbeat"):
            reply = self.state.heartbeat(request)
        if self.on_step is not None:
            self.on_step(self.state.max_step)
        return reply

    def ReportMetrics(self, request, context):
        with refusals(context, CODES, self._log(context), "ReportMetrics"):
            return self.state.report_metrics(request)

    def ReportExit(self, request, context):
        with refusals(context, CODES, self._log(context), "ReportExit"):
            return self.state.exited(request)

    def WatchMembership(self, request, context):
        remaining = context.time_remaining()
        wait_s = MAX_WAIT_S if remaining is None else min(MAX_WAIT_S, remaining - REPLY_MARGIN_S)
        owner = _owner(context)
        try:
            if owner is None:  # the trusted share every slot
                slot = self.watches.take("the trusted callers' watches", self.watches.max_total)
            else:
                slot = self.watches.take(f"{owner}'s watches", owner=owner)
        except PollLimitExceeded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        with slot:
            return self.state.watch(request.after_generation, wait_s)

    def GetClusterStatus(self, request, context):
        return self.state.status()


def watch_slots(max_threads: int) -> PollSlots:
    """The membership watches of a coordinator of `max_threads` handler threads: at most
    `WATCHES_PER_CALLER` per caller, a quarter of the pool left free for heartbeats."""
    return PollSlots.for_pool(max_threads, per_key=WATCHES_PER_CALLER, per_owner=WATCHES_PER_CALLER)


def _owner(context) -> str | None:
    """The share a call is made under: the node its credentials name; None: trusted."""
    grant = getattr(context, GRANT_ATTRIBUTE, None)
    return caller_key(grant.caller if grant is not None else None)


def _handler(servicer: CoordinatorServicer) -> grpc.GenericRpcHandler:
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name),
                                                          request_deserializer=request.FromString,
                                                          response_serializer=reply.SerializeToString)
                for name, (request, reply) in METHODS.items()}
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


@dataclass(frozen=True)
class CoordinatorHooks:
    """What a coordinator's owner is told.

    Attributes:
        on_step: called after each heartbeat with the largest step any node reported.
        on_failure: called with (node id, reason) for every node declared failed by timeout.
    """

    on_step: Callable[[int], None] | None = None
    on_failure: Callable[[str, str], None] | None = None


class CoordinatorServer:
    """A started coordinator: gRPC on `bind` ("HOST:PORT", port 0: a free one; the bound
    one is `.address`) and a monitor thread checking heartbeats every interval / 4.

    Args:
        config: the `coordinator` config section.
        registry_path: the SQLite registry; loaded when it exists, created otherwise.
        hooks: what the owner is told (the largest step heard, each node declared failed).
        credentials: with a token, every call but health checks must carry it (`core.auth`);
            with TLS files enabled, it listens with TLS (`core.tls`; mutual with a CA).

    Raises:
        ConfigError: `bind` is malformed or cannot be bound.
        RegistryError: the registry cannot be used.
    """

    def __init__(self, config: CoordinatorConfig, bind: str, registry_path: str | Path,
                 hooks: CoordinatorHooks = CoordinatorHooks(), max_threads: int = 128,
                 credentials: Credentials | None = None):
        parse_address(bind, "--bind")  # a malformed address is refused before the registry opens
        self.registry = Registry(registry_path)
        self.state = CoordinatorState(config, self.registry)
        self.on_failure = hooks.on_failure
        # Each watch holds a thread: many may wait, and a quarter of the pool stays free for heartbeats.
        watches = watch_slots(max_threads)
        self.servicer = CoordinatorServicer(self.state, hooks.on_step, watches)
        try:
            self._server = RpcServer(_handler(self.servicer), SERVICE, bind, ServerLimits(max_threads),
                                     credentials)
        except ConfigError:
            self.registry.close()
            raise
        self.address = self._server.address
        self.state.opened()
        self._stopped = threading.Event()
        self._monitor = threading.Thread(target=self._watch_heartbeats, args=(config.heartbeat_interval / 4,),
                                         name="heartbeat-monitor", daemon=True)
        self._monitor.start()

    def _watch_heartbeats(self, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            for event in self.state.check():
                if event.kind == "failed" and self.on_failure is not None:
                    self.on_failure(event.node_id, event.detail)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, persist the last progress and close the registry."""
        self._stopped.set()
        self._monitor.join(timeout=5.0)
        self.state.close()
        self._server.stop(grace_s)
        self.registry.close()
