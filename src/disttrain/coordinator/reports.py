"""What a node reports about itself, as typed values: its progress and balance state (in
every heartbeat) and its latest training metrics (in ReportMetrics). No I/O: the
training side produces them, the heartbeat thread reads them and puts them on the wire.

Each value is immutable. A producer that changes one replaces it in one assignment, so a
heartbeat thread reading it at any moment sees a whole value, never half of an update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node is in the run, as it registers and heartbeats.

    Attributes:
        node_id: its id, unique in the run ("worker-0", "server1").
        role: "worker", "server", "rank", ...
        rank: its rank within its role (-1: none asked for).
        address: the address it serves on ("" when it serves nothing).
    """

    node_id: str
    role: str
    rank: int = -1
    address: str = ""


@dataclass(frozen=True)
class BalanceState:
    """A node's balance state under proportional work; 0 means unknown (the coordinator
    then keeps the value it holds).

    Attributes:
        batch_size: its current batch size.
        warmup_speed: samples/s it measured in the warm-up before training.
        plans: balance plans it has been through (1: the one it started with; each
            re-plan adds one).
    """

    batch_size: int = 0
    warmup_speed: float = 0.0
    plans: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 0 or self.plans < 0 or not self.warmup_speed >= 0:
            raise ValueError(f"a balance state has batch_size, warmup_speed and plans >= 0, not {self}")


@dataclass(frozen=True)
class NodeProgress:
    """Where a node is, as its heartbeats tell it.

    Attributes:
        epoch, step: its position (a server: epoch 0, step = its version).
        samples: samples it has trained on so far (throughput comes from its change).
        work_s: seconds of its own work so far, waits for peers left out; None when not
            counted (step time then comes from the wall clock).
        balance: its balance state; None when the run is not balanced (or not yet).
    """

    epoch: int
    step: int
    samples: int
    work_s: float | None = None
    balance: BalanceState | None = None


@dataclass(frozen=True)
class NodeProcess:
    """The process a node registers from, and the machine it runs on.

    Attributes:
        pid: its process id (heartbeats must come from it; 0: not given).
        hostname: the machine's name ("" when not told).
        capabilities: the machine's (CPUs, memory, GPUs; see `node_info.capabilities`).
    """

    pid: int = 0
    hostname: str = ""
    capabilities: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HeartbeatReport:
    """What a heartbeat tells of its node, as the coordinator keeps it.

    Attributes:
        epoch, step: the node's position.
        throughput: samples/s since its last heartbeat (0: unknown).
        step_time_s: seconds per step since its last heartbeat (0: no step finished, the
            last one held stays).
        balance: its balance state (None, or a field at 0: unknown, the value held stays).
    """

    epoch: int = 0
    step: int = 0
    throughput: float = 0.0
    step_time_s: float = 0.0
    balance: BalanceState | None = None


@dataclass(frozen=True)
class NodeMetrics:
    """A node's latest training metrics: namespaced scalars (`loss/train`,
    `accuracy/test`, `throughput/samples_per_s`, ...) and the step and epoch of the newest
    of them."""

    step: int
    epoch: int
    scalars: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeReports:
    """Where a node's heartbeats read what it reports.

    Attributes:
        progress: the node's progress (and a worker's balance state), read at every
            heartbeat.
        metrics: its latest training metrics, read after every heartbeat and reported when
            new (None: it reports none).
    """

    progress: Callable[[], NodeProgress]
    metrics: Callable[[], NodeMetrics | None] | None = None


class LatestMetrics:
    """The latest value of every metric one training loop has logged, read by its
    heartbeat thread. One writer (the loop, through `publish`); any number of readers.
    """

    def __init__(self) -> None:
        self._latest: NodeMetrics | None = None

    def publish(self, step: int, epoch: int, scalars: Mapping[str, float]) -> None:
        """Take the figures the loop just logged; a key not among them keeps its last value
        (the test accuracy of the latest evaluation stays beside newer training loss).
        Non-finite values and non-numbers are left out. Cheap: never waits for anything."""
        merged = dict(self._latest.scalars) if self._latest is not None else {}
        merged.update({key: float(value) for key, value in scalars.items()
                       if isinstance(value, int | float) and math.isfinite(value)})
        self._latest = NodeMetrics(step, epoch, MappingProxyType(merged))  # one assignment

    def latest(self) -> NodeMetrics | None:
        """The newest metrics (a new object after every `publish`), or None before any."""
        return self._latest
