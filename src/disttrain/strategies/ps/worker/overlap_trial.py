"""Whether the overlapped push pays on this machine, by measurement: the first steps of a
synchronous worker alternate overlapped and plain pushes, and the worker keeps the side
whose median step took less time.

Overlap hides communication behind backward only where there is a core to run it on. On
a machine whose cores are all busy computing (two workers and two shard servers on two
cores), the communication's own CPU work (serialising, the gRPC threads, the shard's
reply) competes with backward instead, and with few shards most of a push can leave
only near the end of backward anyway: the overlapped step is then slower than the plain
one (see docs/parameter-server.md, "Overlap"). Neither is known before the run, so the
worker measures both (`ps.overlap_trial_steps`).

Pure: the exchange says which side a step used and how long it took; nothing here reads
a clock, so tests step through a trial with timings of their own. Sides alternate by the
step's parity, so that the workers of a synchronous run (which step together) try the
same side at the same step and each side's timing is not mixed with the other's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class OverlapTrial:
    """Times the first steps both ways and keeps the faster.

    Args:
        steps_each: steps timed per side (> 0).
        warmup_steps: steps run first (overlapped) and not timed: the first step builds
            the autograd graph, fills the allocator and may wait for the shards.
    Raises:
        ValueError: `steps_each` < 1 or `warmup_steps` < 0.
    """

    steps_each: int
    warmup_steps: int = 2
    timed: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    chosen: bool | None = None  # None: still measuring
    _seen: int = 0

    def __post_init__(self) -> None:
        if self.steps_each < 1:
            raise ValueError(f"steps_each must be >= 1 (got {self.steps_each})")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0 (got {self.warmup_steps})")

    def overlaps(self, step: int) -> bool:
        """Whether the push of `step` (the run's step) overlaps backward: the choice once
        made; while measuring, overlapped on odd steps and plain on even ones, each side
        until it has its `steps_each` timings (then the other)."""
        if self.chosen is not None:
            return self.chosen
        if self._seen < self.warmup_steps:
            return True
        side = step % 2 == 1
        return side if len(self.timed[side]) < self.steps_each else not side

    def record(self, overlapped: bool, step_s: float) -> bool:
        """Count one finished step that ran `overlapped` (or not) in `step_s` seconds.
        Returns True when this timing made the choice (the caller logs `describe`)."""
        if self.chosen is not None:
            return False
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return False
        if len(self.timed[overlapped]) < self.steps_each:
            self.timed[overlapped].append(step_s)
        if all(len(times) >= self.steps_each for times in self.timed.values()):
            # A tie goes to the plain push: it does less work on the cores.
            self.chosen = self.median(True) < self.median(False)
            return True
        return False

    def median(self, overlapped: bool) -> float:
        """The median step time of one side so far (seconds); NaN before any timing."""
        times = self.timed[overlapped]
        return statistics.median(times) if times else float("nan")

    def describe(self) -> str:
        """One line for the log: both medians and the side kept."""
        kept = "overlapped" if self.chosen else "plain"
        return (f"overlap trial over {self.steps_each} step(s) each: overlapped pushes took "
                f"{self.median(True):.4f} s a step (median), plain pushes {self.median(False):.4f} s; "
                f"keeping the {kept} push (ps.overlap_trial_steps: 0 always overlaps)")
