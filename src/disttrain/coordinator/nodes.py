"""One process of the run as the coordinator sees it (`Node`), what happened to it
(`Event`, `Recovery`), and the rules for its balance state and metrics. No I/O, no clock
of its own: the membership rules across nodes live in `membership.py`.

Balance state (proportional work): each node reports its current batch size, the speed
it measured in its warm-up (samples/s) and how many balance plans it has been through
(1: the plan it started with). 0 means unknown, so a heartbeat of an unbalanced node, or
one sent before the node has a plan, leaves what the coordinator holds. A rise in plans
above a known count is a re-plan: worth an event. A restarted process starts over.

Metrics: the latest value of each scalar a node reported (its training loss, its latest
test accuracy, ...). A restarted process's reports update them; until then they are the
node's latest known figures, and stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from disttrain.coordinator.reports import BalanceState

ALIVE, FAILED, DONE = "alive", "failed", "done"
# A parameter-server worker failed for longer than `reassign_after`: its blocks go to the others.
REASSIGNED = "reassigned"
EVENT_KINDS = ("joined", "failed", "restarted", "recovered", "done", "straggler", "rebalanced", "reassigned")
# Node fields holding times of the caller's monotonic clock; rows hold them as wall time.
CLOCK_FIELDS = ("last_heartbeat", "last_seen", "failed_at", "last_heard")


@dataclass
class Node:
    """One process of the run as the coordinator sees it."""

    node_id: str
    role: str
    rank: int = -1
    address: str = ""
    hostname: str = ""
    pid: int = 0
    capabilities: dict[str, Any] = field(default_factory=dict)  # cpus, memory_bytes, gpu, gpu_count
    state: str = ALIVE
    joined_generation: int = 0
    restarts: int = 0
    last_heartbeat: float | None = None  # None: no heartbeat since it (re)registered
    last_seen: float | None = None  # its latest registration or heartbeat
    epoch: int = 0
    step: int = 0
    throughput: float = 0.0
    step_time_s: float = 0.0
    straggler: bool = False
    # Failure bookkeeping, for the recovery figures.
    failed_at: float | None = None  # when the failure was detected
    last_heard: float | None = None  # its last heartbeat before that (None: exit reported)
    failure_reason: str = ""
    recovering: bool = False  # registered again after a failure; waiting for a heartbeat
    # Balance state (0: unknown or not balanced).
    batch_size: int = 0
    warmup_speed: float = 0.0  # samples/s measured before training
    plans: int = 0  # balance plans so far: 1 = the one it started with
    # Its latest training metrics (metric key -> value) and the step of the newest.
    metrics: dict[str, float] = field(default_factory=dict)
    metrics_step: int = 0

    def update_balance(self, balance: BalanceState) -> str | None:
        """Take a heartbeat's balance state; a 0 keeps the value held.

        Returns:
            The detail of a "rebalanced" event ("batch 64 -> 96 (plan 2)") when its plans rose
            above a known count (a first report, or a lower count, is no re-plan), else None.
        """
        detail = None
        if balance.plans > self.plans > 0:
            detail = f"batch {self.batch_size or '?'} -> {balance.batch_size or '?'} (plan {balance.plans})"
        if balance.batch_size > 0:
            self.batch_size = balance.batch_size
        if balance.warmup_speed > 0:
            self.warmup_speed = balance.warmup_speed
        if balance.plans > 0:
            self.plans = balance.plans
        return detail

    def update_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """Take a metrics report: each scalar replaces the value held of its key."""
        self.metrics = {**self.metrics, **scalars}
        self.metrics_step = step

    def restart(self) -> None:
        """Forget what only its previous process knew: a new one reports its own."""
        self.straggler, self.step_time_s, self.throughput = False, 0.0, 0.0
        self.batch_size, self.warmup_speed, self.plans = 0, 0.0, 0


@dataclass(frozen=True)
class Event:
    """Something that happened to a node. `time` is on the clock of the `now` it came from
    until `Membership.take_events` shifts it (e.g. onto the wall clock)."""

    node_id: str
    kind: str
    detail: str
    generation: int
    time: float = 0.0


@dataclass(frozen=True)
class Recovery:
    """A node back at work after a failure. `time` (when its first heartbeat after the
    failure came) is on the clock of the `now` it came from until
    `Membership.take_recoveries` shifts it, like an event's.

    Attributes:
        reason: why it failed ("killed by SIGKILL", "no heartbeat for 1.52s").
        detect_s: from its last heartbeat to the failure being declared (0: its exit was
            reported, so no heartbeat had to be missed).
        recover_s: from the failure being declared to its first heartbeat after it.
        generation: the membership generation at its recovery.
    """

    node_id: str
    reason: str
    detect_s: float
    recover_s: float
    time: float
    generation: int


def node_row(node: Node, clock_offset_s: float = 0.0) -> dict[str, Any]:
    """`node` as a plain dict, its clock fields shifted by `clock_offset_s`."""
    row = asdict(node)
    for name in CLOCK_FIELDS:
        if row[name] is not None:
            row[name] += clock_offset_s
    return row
