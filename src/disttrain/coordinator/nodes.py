"""One process of the run as the coordinator sees it (`Node`), what happened to it
(`Event`), and the rule for its balance state. No I/O, no clock of its own: the
membership rules across nodes live in `membership.py`.

Balance state (proportional work): each node reports its current batch size, the speed
it measured in its warm-up (samples/s) and how many balance plans it has been through
(1: the plan it started with). 0 means unknown, so a heartbeat of an older sender, or
one sent before the node has a plan, leaves what the coordinator holds. A rise in plans
above a known count is a re-plan: worth an event. A restarted process starts over.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ALIVE, FAILED, DONE = "alive", "failed", "done"
EVENT_KINDS = ("joined", "failed", "restarted", "recovered", "done", "straggler", "rebalanced")
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

    def update_balance(self, batch_size: int = 0, warmup_speed: float = 0.0, plans: int = 0) -> str | None:
        """Take a heartbeat's balance state; a 0 keeps the value held.

        Returns:
            The detail of a "rebalanced" event ("batch 64 -> 96 (plan 2)") when `plans` rose
            above a known count (a first report, or a lower count, is no re-plan), else None.
        """
        detail = None
        if plans > self.plans > 0:
            detail = f"batch {self.batch_size or '?'} -> {batch_size or '?'} (plan {plans})"
        if batch_size > 0:
            self.batch_size = batch_size
        if warmup_speed > 0:
            self.warmup_speed = warmup_speed
        if plans > 0:
            self.plans = plans
        return detail

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


def node_row(node: Node, clock_offset_s: float = 0.0) -> dict[str, Any]:
    """`node` as a plain dict, its clock fields shifted by `clock_offset_s`."""
    row = asdict(node)
    for name in CLOCK_FIELDS:
        if row[name] is not None:
            row[name] += clock_offset_s
    return row
