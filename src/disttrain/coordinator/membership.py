"""Who is in the run and who is alive: the coordinator's decisions, with no I/O.

Every method takes the time as `now` (monotonic seconds of the caller's clock), so tests
step a fake clock by hand. The gRPC service, the registry and the monitor thread live
elsewhere; they call in here and persist what changed (`take_events`, `to_rows`).

Rules:
- A node is declared failed once it has been silent for more than `heartbeat_timeout_s`
  (`check`), or at once when its supervisor reports a non-zero exit (`exited`).
- A node registering again after a failure, or after its old process went silent
  (another pid, no heartbeat within the timeout), rejoins: `restarts` += 1. A live node's
  id claimed by another process is refused (`DuplicateNode`).
- A rank of a role is its first node's for as long as the table holds that node, alive
  or not: another node registering with it is refused (`RankTaken`), so a node cannot
  take the rank of one that failed, is restarting or was taken over, nor of one the
  coordinator reloaded and has not heard from since. A node keeps its own rank: it
  registers again with it (or with -1, not known: it keeps it), never with another's.
- A parameter-server worker (role "worker") failed for longer than `reassign_after_s`
  is *reassigned* (`check`): the other workers take over its blocks of the epoch not yet
  applied. It may still rejoin (a restart), and then takes back what is left.
- Every membership change (join, rejoin, failure, reassignment, done) starts a new
  `generation`.
- A straggler is a live node whose step time exceeds `straggler_factor` times the median
  step time of the other live nodes of its role.
- A node's balance plans rising above a known count is a "rebalanced" event (no new
  generation: the membership is the same); see `nodes.py`.
- A node back at work after a failure (its first heartbeat after registering again) is a
  "recovered" event and a `Recovery` record, with the time the failure took to detect
  and the node to recover.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import fields, replace
from typing import Any

from disttrain.coordinator.nodes import (
    ALIVE,
    CLOCK_FIELDS,
    DONE,
    FAILED,
    REASSIGNED,
    Event,
    Node,
    Recovery,
    node_row,
)
from disttrain.coordinator.reports import BalanceState, HeartbeatReport, NodeProcess
from disttrain.core.errors import DisttrainError

ROLES = ("worker", "server", "rank", "coordinator")
MAX_NODES = 1024  # nodes held; past it the oldest ended ones are forgotten
MAX_METRICS = 256  # metric keys kept per node: its registry row stays small


class DuplicateNode(DisttrainError):
    """Another live process already holds this node id. Not recoverable by retrying:
    stop the other process or pick another id."""


class RankTaken(DuplicateNode):
    """A rank held by another node of the role (its first node's, alive or not), or a
    rank other than the node's own. Not recoverable by retrying: register with the
    node's own rank."""


class NodeTableFull(DisttrainError):
    """Every place of the node table is held by a live node. Recoverable once nodes end
    (the oldest ended ones are forgotten to make room), or with a larger
    `coordinator.max_nodes`."""


class WrongProcess(DisttrainError):
    """A call names a node's pid or generation other than the ones the coordinator holds:
    it is not from the node's current process (or its supervisor). Not recoverable by
    retrying."""


class UnknownNode(DisttrainError):
    """A heartbeat from a node id never registered (e.g. the coordinator restarted without
    its registry). Recoverable: register again."""


class Membership:
    """The run's nodes, their liveness and the membership generation.

    Args:
        heartbeat_timeout_s: silence after which a live node is declared failed.
        straggler_factor: how much slower than its role's median a straggler is (> 1).
        reassign_after_s: how long a failed worker may stay away before it is reassigned
            (None: never).
    """

    def __init__(self, heartbeat_timeout_s: float, straggler_factor: float = 2.0,
                 reassign_after_s: float | None = None, max_nodes: int = MAX_NODES):
        if heartbeat_timeout_s <= 0 or straggler_factor <= 1 or max_nodes < 1:
            raise ValueError("heartbeat_timeout_s must be > 0, straggler_factor > 1 and max_nodes >= 1")
        if reassign_after_s is not None and reassign_after_s <= 0:
            raise ValueError("reassign_after_s must be > 0, or None (never)")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.straggler_factor = straggler_factor
        self.reassign_after_s = reassign_after_s
        self.max_nodes = max_nodes
        self.generation = 0
        self._nodes: dict[str, Node] = {}
        self._pending: list[Event] = []
        self._recoveries: list[Recovery] = []  # not taken yet (`take_recoveries`)
        self._unconfirmed: set[str] = set()  # reloaded as alive, not heard from since
        self._slow_since: dict[str, float] = {}  # node -> when it was first seen slow, while it is
        self._dirty: set[str] = set()  # nodes changed since `take_changes`
        self._forgotten: set[str] = set()  # nodes dropped from the table since `take_changes`

    def register(self, node_id: str, role: str, now: float, rank: int = -1, address: str = "",
                 process: NodeProcess | None = None) -> Node:
        """Join, rejoin after a failure or restart, or repeat a registration (the same pid of
        `process`: no change).

        Raises:
            ValueError: an empty id or an unknown role.
            DuplicateNode: a live process with another pid, heard within the timeout, holds
                the id.
            RankTaken: another node of the role holds `rank` (its first node's, in any
                state), or the node holds another rank of its own.
            NodeTableFull: a new id, and `max_nodes` live nodes are held.
        """
        process = process or NodeProcess()
        pid, hostname, capabilities = process.pid, process.hostname, process.capabilities
        if not node_id:
            raise ValueError("node id is empty; give every process a unique id, e.g. worker-0")
        if role not in ROLES:
            raise ValueError(f"role {role!r} is unknown; use one of {', '.join(ROLES)}")
        node = self._nodes.get(node_id)
        if node is not None and node.rank >= 0 and rank == -1:
            rank = node.rank  # not known to the caller: the node's own
        self._check_rank_free(node_id, role, rank, node)
        if node is not None and node.state == ALIVE and node.pid == pid:
            node.last_seen = now
            self._dirty.add(node_id)
            return node
        # Reloaded but not heard since: another pid is its restart (the old one died meanwhile).
        if node is not None and node.state == ALIVE and not self._silent(node, now) \
                and node_id not in self._unconfirmed:
            age = now - (node.last_seen or now)
            raise DuplicateNode(
                f"node id {node_id!r} is held by a live process (pid {node.pid}, heard "
                f"{age:.1f}s ago); stop that process, or give this one another id")
        details = dict(role=role, rank=rank, address=address, hostname=hostname, pid=pid,
                       capabilities=dict(capabilities or {}))
        if node is None:
            self._make_room()
            node = self._nodes[node_id] = Node(node_id, **details)
            self._change(node, ALIVE, "joined", f"{role} pid {pid} on {hostname or '?'}", now)
        else:
            self._rejoin(node, details, now)
        node.joined_generation = self.generation
        node.last_seen, node.last_heartbeat = now, None
        self._unconfirmed.discard(node_id)
        self._dirty.add(node_id)
        return node

    def _check_rank_free(self, node_id: str, role: str, rank: int, node: Node | None) -> None:
        """Raise RankTaken when `node` (`node_id`'s, None: new) holds another rank of
        `role`, or another node of `role` holds `rank` (-1: no rank, never held), in
        whatever state: a rank is its first node's while the table holds that node."""
        if node is not None and node.role == role and node.rank >= 0 and rank != node.rank:
            raise RankTaken(f"node {node_id!r} holds {role} rank {node.rank}, not {rank}; a node registers "
                            "again with its own rank (or -1)")
        if rank < 0:
            return
        for other in self._nodes.values():
            if other.node_id != node_id and other.role == role and other.rank == rank:
                raise RankTaken(f"{role} rank {rank} is node {other.node_id!r}'s ({other.state}); a rank "
                                "stays its node's, restarted or not: register this node with its own "
                                "rank, or restart that node under its own id")

    def _make_room(self) -> None:
        """Forget the oldest ended node (done first, then failed or reassigned) when the
        table is full; raise NodeTableFull when every node held is alive."""
        if len(self._nodes) < self.max_nodes:
            return
        ended = [n for n in self._nodes.values() if n.state != ALIVE]
        if not ended:
            raise NodeTableFull(f"the coordinator holds {len(self._nodes)} live nodes, its limit "
                                "(coordinator.max_nodes); raise it, or end some nodes first")
        oldest = min(ended, key=lambda n: (n.state != DONE, n.last_seen or float("-inf")))
        del self._nodes[oldest.node_id]
        self._slow_since.pop(oldest.node_id, None)
        self._dirty.discard(oldest.node_id)
        self._forgotten.add(oldest.node_id)

    def _rejoin(self, node: Node, details: dict[str, Any], now: float) -> None:
        if node.state == ALIVE:  # restarted before its silence was noticed
            self._mark_failed(node, now, "restarted before its heartbeats were missed", node.last_seen)
        was_failed = node.state in (FAILED, REASSIGNED)
        for key, value in details.items():
            setattr(node, key, value)
        node.restarts += 1
        node.recovering = was_failed
        node.restart()
        self._change(node, ALIVE, "restarted", f"restart {node.restarts}, pid {node.pid}", now)

    def heartbeat(self, node_id: str, now: float, pid: int = 0,
                  report: HeartbeatReport | None = None) -> bool:
        """Record a heartbeat of process `pid` and what it reports (the sender's position,
        speed and balance state). Returns False when the sender is considered dead (failed):
        it must exit.

        Raises:
            UnknownNode: `node_id` never registered.
            WrongProcess: `pid` is not the pid the node registered with (0 included): the
                heartbeat is not its process's, and changes nothing.
        """
        node = self._nodes.get(node_id)
        if node is None:
            raise UnknownNode(f"node {node_id!r} is not registered; register it first")
        if pid != node.pid:
            raise WrongProcess(f"node {node_id!r} is held by another process than pid {pid}; a process "
                               "heartbeats under the id it registered, and registers again after a restart")
        if node.state in (FAILED, REASSIGNED):
            return False
        self._unconfirmed.discard(node_id)
        self._dirty.add(node_id)
        report = report or HeartbeatReport()
        node.epoch, node.step, node.throughput = report.epoch, report.step, report.throughput
        if report.step_time_s > 0:  # no step since the last heartbeat (an evaluation): the last one holds
            node.step_time_s = report.step_time_s
        node.last_heartbeat = node.last_seen = now
        rebalanced = node.update_balance(report.balance or BalanceState())
        if rebalanced is not None:
            self._emit(node, "rebalanced", rebalanced, now)
        if node.recovering:
            self._recovered(node, now)
        return True

    def _recovered(self, node: Node, now: float) -> None:
        assert node.failed_at is not None
        detect_s = 0.0 if node.last_heard is None else node.failed_at - node.last_heard
        recovery = Recovery(node.node_id, node.failure_reason, round(detect_s, 3),
                            round(now - node.failed_at, 3), now, self.generation)
        self._recoveries.append(recovery)
        node.recovering = False
        detected = ("its exit was reported" if node.last_heard is None
                    else f"declared {recovery.detect_s:.3f}s after its last heartbeat")
        detail = f"back at work {recovery.recover_s:.3f}s after it failed ({recovery.reason}; {detected})"
        self._emit(node, "recovered", detail, now)

    def report_metrics(self, node_id: str, step: int, scalars: dict[str, float]) -> None:
        """Keep a node's latest metrics: each scalar replaces the value held of its key.

        Raises:
            UnknownNode: `node_id` never registered.
            ValueError: a value is not finite, or the node would hold more than
                `MAX_METRICS` keys (nothing is kept of the report).
        """
        node = self._nodes.get(node_id)
        if node is None:
            raise UnknownNode(f"node {node_id!r} is not registered; register it first")
        bad = sorted(key for key, value in scalars.items() if not math.isfinite(value))
        if bad:
            raise ValueError(f"metrics of {node_id!r}: {', '.join(bad)} not finite; report finite values")
        if len(node.metrics.keys() | scalars.keys()) > MAX_METRICS:
            raise ValueError(f"metrics of {node_id!r}: more than {MAX_METRICS} keys; report fewer metrics")
        node.update_metrics(step, scalars)
        self._dirty.add(node_id)

    def exited(self, node_id: str, code: int, reason: str, now: float, pid: int | None = None,
               generation: int | None = None) -> bool:
        """A supervisor saw the node's process exit: code 0 -> done, else failed at once.
        Returns False when the node is unknown. A node already failed or done is left as is.

        Raises:
            WrongProcess: `pid` or `generation` (None: not checked) is not the node's current
                process's (its pid, its `joined_generation`): the report is about another
                process, and changes nothing.
        """
        node = self._nodes.get(node_id)
        if node is None:
            return False
        if (pid is not None and pid != node.pid) or (generation is not None
                                                     and generation != node.joined_generation):
            raise WrongProcess(f"node {node_id!r} is not pid {pid} of generation {generation}; report the "
                               "exit of the node's current process, with the pid and generation it "
                               "registered with")
        if node.state == ALIVE and code == 0:
            self._change(node, DONE, "done", reason or "exit code 0", now)
        elif node.state == ALIVE:
            self._mark_failed(node, now, reason or f"exit code {code}", None)
        return True

    def check(self, now: float) -> list[Event]:
        """Declare failed every live node silent for more than the timeout, reassign the
        workers failed for longer than `reassign_after_s`, and flag the stragglers. Returns
        the events this produced (also queued for `take_events`)."""
        found = []
        for node in self._nodes.values():
            if node.state == ALIVE and self._silent(node, now):
                silent_s = now - (node.last_seen or now)
                found.append(self._mark_failed(node, now, f"no heartbeat for {silent_s:.2f}s",
                                               node.last_heartbeat or node.last_seen))
            elif self._due_for_reassignment(node, now):
                detail = (f"away {now - node.failed_at:.2f}s since it failed ({node.failure_reason}); "
                          "the other workers take over its blocks")
                found.append(self._change(node, REASSIGNED, "reassigned", detail, now))
        slow = self._held(self.stragglers(), now)
        for node in self._nodes.values():
            if node.node_id in slow and not node.straggler:
                detail = (f"step time {node.step_time_s:.3f}s, over {self.straggler_factor:g}x "
                          "the median of its role")
                found.append(self._emit(node, "straggler", detail, now))
            if node.straggler != (node.node_id in slow):
                node.straggler = not node.straggler
                self._dirty.add(node.node_id)
        return found

    def _held(self, slow: set[str], now: float) -> set[str]:
        """Those of `slow` that have been slow for longer than the heartbeat timeout (a
        one-off slow step, e.g. while a restarted peer catches up, flags nobody)."""
        self._slow_since = {n: self._slow_since.get(n, now) for n in slow}
        return {n for n, since in self._slow_since.items() if now - since >= self.heartbeat_timeout_s}

    def _due_for_reassignment(self, node: Node, now: float) -> bool:
        return (self.reassign_after_s is not None and node.role == "worker" and node.state == FAILED
                and node.failed_at is not None and now - node.failed_at >= self.reassign_after_s)

    def _silent(self, node: Node, now: float) -> bool:
        return node.last_seen is not None and now - node.last_seen > self.heartbeat_timeout_s

    def _mark_failed(self, node: Node, now: float, reason: str, last_heard: float | None) -> Event:
        node.failed_at, node.last_heard, node.failure_reason = now, last_heard, reason
        node.recovering = node.straggler = False
        return self._change(node, FAILED, "failed", reason, now)

    def _change(self, node: Node, state: str, kind: str, detail: str, now: float) -> Event:
        node.state = state
        self.generation += 1
        return self._emit(node, kind, detail, now)

    def _emit(self, node: Node, kind: str, detail: str, now: float) -> Event:
        self._dirty.add(node.node_id)
        event = Event(node.node_id, kind, detail, self.generation, now)
        self._pending.append(event)
        return event

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def members(self) -> list[Node]:
        """Every node ever registered, by role, rank and id."""
        return sorted(self._nodes.values(), key=lambda n: (n.role, n.rank, n.node_id))

    @property
    def run_finished(self) -> bool:
        """Whether the run's work is over: it has shard servers, and every one is done (the
        first worker stops them once every worker finished or was taken over)."""
        servers = [node for node in self._nodes.values() if node.role == "server"]
        return bool(servers) and all(node.state == DONE for node in servers)

    def stragglers(self) -> set[str]:
        """Live nodes slower than `straggler_factor` x the median step time of the other
        live nodes of their role (nodes with no step time yet left out; >= 2 needed)."""
        slow = set()
        for role in ROLES:
            timed = [n for n in self._nodes.values()
                     if n.role == role and n.state == ALIVE and n.step_time_s > 0]
            for node in timed if len(timed) >= 2 else []:
                others = statistics.median(n.step_time_s for n in timed if n is not node)
                if node.step_time_s > self.straggler_factor * others:
                    slow.add(node.node_id)
        return slow

    def take_recoveries(self, clock_offset_s: float = 0.0) -> list[Recovery]:
        """The recoveries since the last call, oldest first, their times shifted by
        `clock_offset_s` (as `take_events`)."""
        recoveries, self._recoveries = self._recoveries, []
        return [replace(r, time=r.time + clock_offset_s) for r in recoveries]

    @property
    def has_events(self) -> bool:
        """Whether events wait for `take_events`."""
        return bool(self._pending)

    def take_events(self, clock_offset_s: float = 0.0) -> list[Event]:
        """The events since the last call, oldest first, their times shifted by
        `clock_offset_s` (wall clock - monotonic clock puts them on the wall clock)."""
        events, self._pending = self._pending, []
        return [Event(e.node_id, e.kind, e.detail, e.generation, e.time + clock_offset_s) for e in events]

    def to_rows(self, clock_offset_s: float = 0.0) -> list[dict[str, Any]]:
        """Every node as a plain dict, its clock fields shifted by `clock_offset_s`."""
        return [node_row(node, clock_offset_s) for node in self.members()]

    def changes(self, clock_offset_s: float = 0.0) -> tuple[list[dict[str, Any]], list[str]]:
        """The nodes changed (as `to_rows`) and the ids forgotten (to make room for new ones)
        since the last `changes_saved`: what a registry must write to hold the table."""
        rows = [node_row(self._nodes[node_id], clock_offset_s) for node_id in sorted(self._dirty)]
        return rows, sorted(self._forgotten)

    def changes_saved(self) -> None:
        """`changes` were written: the next ones start from here."""
        self._dirty, self._forgotten = set(), set()

    def restore(self, rows: list[dict[str, Any]], generation: int, now: float,
                clock_offset_s: float = 0.0) -> None:
        """Load `to_rows` output (times shifted back by `clock_offset_s`). Every live node
        gets a fresh timeout window from `now`: a restarted coordinator heard nobody yet.
        Past `max_nodes` rows (a registry of a coordinator with a larger limit), live nodes
        and the latest heard are kept, and the others forgotten (`changes`)."""
        names = {f.name for f in fields(Node)}
        self._nodes = {}
        rows = sorted(rows, key=lambda r: (r["state"] != ALIVE, -(r.get("last_seen") or float("-inf"))))
        self._forgotten.update(row["node_id"] for row in rows[self.max_nodes:])
        for row in rows[:self.max_nodes]:
            node = Node(**{k: v for k, v in row.items() if k in names})
            for name in CLOCK_FIELDS:
                value = getattr(node, name)
                setattr(node, name, None if value is None else value - clock_offset_s)
            if node.state == ALIVE:
                node.last_seen = now
                self._unconfirmed.add(node.node_id)
            self._nodes[node.node_id] = node
        self.generation = generation

    def opened(self, now: float) -> None:
        """The coordinator started serving at `now`: every node reloaded and not heard from
        since gets its timeout window from here, not from the reload (until now it could
        not reach us; a restarted coordinator's start-up would otherwise eat its window)."""
        for node_id in self._unconfirmed:
            node = self._nodes.get(node_id)
            if node is not None and node.state == ALIVE:
                node.last_seen = now

