"""Whether the overlapped push pays on this machine, by measurement: the first steps of a
synchronous worker run overlapped and plain pushes in pairs of adjacent steps, and the
worker keeps the overlap only where it won by a clear margin over the noise it saw.

Overlap hides communication behind backward only where there is a core to run it on. On
a machine whose cores are all busy computing (two workers and two shard servers on two
cores), the communication's own CPU work (serialising, the gRPC threads, the shard's
reply) competes with backward instead, and with few shards most of a push can leave
only near the end of backward anyway: the overlapped step is then slower than the plain
one (see docs/parameter-server.md, "Overlap"). Neither is known before the run, so the
worker measures both (`ps.overlap_trial_steps`).

The rule (`judge`) is built so that keeping the overlap is never a worse bet than
keeping the plain push. The steps come in pairs, one of each side, in the order ABBA
(overlapped then plain, then plain then overlapped, ...): a load that rises or falls
during the trial then favours each side in half the pairs, and cancels in the median of
the pairs' gains instead of deciding it. The overlap is kept only where that median gain
exceeds both the gains' own spread (their median absolute deviation: how much the pairs
disagree) and a small floor (`MIN_GAIN`, a share of the plain step); a near-tie, a noisy
sample, or a win smaller than the floor keeps the plain push, which does less work on
the cores. A wrong "plain" costs at most the gain that was not clear; a wrong "overlap"
could cost any amount, so the doubt goes to plain.

The trial is sequential: it judges after the configured pairs and, where undecided (the
median gain positive but not beyond the margin), runs as many pairs again and judges
all of them, up to `MAX_ROUNDS` times the configured pairs; a gain of zero or less (a tie
or a clear loss) stops at once with the plain push, and so does the cap reached
undecided. Under load the pairs' gains spread as widely as they average, and 4 pairs then
cannot show a real gain of 30%; 8 or 12 can, and a clear case still stops at 4.

Pure: the exchange says which side a step used and how long it took; nothing here reads
a clock, so tests step through a trial with timings of their own. The order of the sides
follows the trial's own count of steps, so the workers of a synchronous run (which step
together, from the same step) try the same side at the same step while they measure and
each side's timing is not mixed with the other's. Each worker judges its own clock, so
two workers may stop after different numbers of rounds (and keep different sides, as
before: both push the same gradient, so what is trained does not depend on it). A
worker still measuring then times both sides of each pair against a worker whose side
no longer changes, so the pair's comparison stays fair.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_GAIN = 0.02  # the overlap must save more than this share of the plain step to be kept
MAX_ROUNDS = 3  # undecided: more rounds of the configured pairs, up to this many in all


@dataclass(frozen=True)
class Verdict:
    """The trial's figures: the median gain of the overlapped step over the plain one in
    a pair (seconds; > 0: overlap faster), the gains' spread (median absolute deviation),
    the gain needed to keep the overlap, and whether it did."""

    gain_s: float
    spread_s: float
    needed_s: float
    keep_overlap: bool

    @property
    def undecided(self) -> bool:
        """The overlap looked faster, but not by the margin: more pairs may tell. A gain
        of zero or less is decided (plain): more pairs would only confirm a tie or a loss."""
        return not self.keep_overlap and self.gain_s > 0


def judge(overlapped: Sequence[float], plain: Sequence[float], min_gain: float = MIN_GAIN) -> Verdict:
    """Compare paired step times: `overlapped[i]` and `plain[i]` are the two steps of pair
    `i` (seconds). The overlap is kept only where the median of the gains `plain[i] -
    overlapped[i]` is larger than both their median absolute deviation and `min_gain`
    times the median plain step.

    Raises:
        ValueError: no pairs, or the two sides of different lengths.
    """
    if not overlapped or len(overlapped) != len(plain):
        raise ValueError(f"the trial needs as many overlapped as plain step times, at least one "
                         f"(got {len(overlapped)} and {len(plain)})")
    gains = [p - o for o, p in zip(overlapped, plain, strict=True)]
    gain = statistics.median(gains)
    spread = statistics.median(abs(g - gain) for g in gains)
    needed = max(spread, min_gain * statistics.median(plain))
    return Verdict(gain, spread, needed, gain > needed)


@dataclass
class OverlapTrial:
    """Times the first steps both ways, in ABBA pairs, and keeps the overlap only on a
    clear win (`judge`).

    Args:
        steps_each: pairs timed in a round, one step per side each (> 0); undecided
            after a round, the trial runs another, up to `max_rounds` in all.
        warmup_steps: steps run first (overlapped) and not timed: the first step builds
            the autograd graph, fills the allocator and may wait for the shards.
        min_gain: the share of the plain step the overlap must save (`judge`).
        max_rounds: the most rounds of `steps_each` pairs; undecided after the last,
            the plain push is kept.
    Raises:
        ValueError: `steps_each` < 1, `warmup_steps` < 0, `min_gain` < 0 or
            `max_rounds` < 1.
    """

    steps_each: int
    warmup_steps: int = 2
    min_gain: float = MIN_GAIN
    max_rounds: int = MAX_ROUNDS
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (overlapped, plain) seconds
    chosen: bool | None = None  # None: still measuring
    verdict: Verdict | None = None
    _pending: tuple[bool, float] | None = None  # the first step of a pair, waiting for its second
    _seen: int = 0

    def __post_init__(self) -> None:
        if self.steps_each < 1:
            raise ValueError(f"steps_each must be >= 1 (got {self.steps_each})")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0 (got {self.min_gain})")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1 (got {self.max_rounds})")

    def overlaps(self) -> bool:
        """Whether the next step's push overlaps backward: the choice once made; while
        measuring, the side a pair still lacks, or for a new pair overlapped first in even
        pairs and plain first in odd ones (ABBA)."""
        if self.chosen is not None:
            return self.chosen
        if self._seen < self.warmup_steps:
            return True
        if self._pending is not None:
            return not self._pending[0]
        return len(self.pairs) % 2 == 0

    def record(self, overlapped: bool, step_s: float) -> bool:
        """Count one finished step that ran `overlapped` (or not) in `step_s` seconds.
        Returns True when this timing made the choice (the caller logs `describe`): at
        the end of a round, unless undecided with rounds left."""
        if self.chosen is not None:
            return False
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return False
        if self._pending is None or self._pending[0] == overlapped:
            self._pending = (overlapped, step_s)  # a side repeated: its latest time opens the pair
            return False
        first, self._pending = self._pending[1], None
        self.pairs.append((first, step_s) if not overlapped else (step_s, first))
        if len(self.pairs) % self.steps_each:
            return False
        timed = self.timed
        self.verdict = judge(timed[True], timed[False], self.min_gain)
        if self.verdict.undecided and len(self.pairs) < self.steps_each * self.max_rounds:
            return False
        self.chosen = self.verdict.keep_overlap
        return True

    @property
    def timed(self) -> dict[bool, list[float]]:
        """The paired step times of each side so far (seconds), in pair order."""
        return {True: [o for o, _ in self.pairs], False: [p for _, p in self.pairs]}

    def median(self, overlapped: bool) -> float:
        """The median step time of one side so far (seconds); NaN before any pair."""
        times = self.timed[overlapped]
        return statistics.median(times) if times else float("nan")

    def describe(self) -> str:
        """One line for the log: both medians, the gain against the margin, the side kept."""
        kept = "overlapped" if self.chosen else "plain"
        verdict = self.verdict or Verdict(float("nan"), float("nan"), float("nan"), False)
        undecided = ", undecided at the cap" if self.verdict is not None and self.verdict.undecided else ""
        return (f"overlap trial over {len(self.pairs)} step(s) each: overlapped pushes took "
                f"{self.median(True):.4f} s a step (median), plain pushes {self.median(False):.4f} s; "
                f"median gain {verdict.gain_s:.4f} s a pair, needed more than {verdict.needed_s:.4f} s "
                f"(spread {verdict.spread_s:.4f} s){undecided}; keeping the {kept} push "
                f"(ps.overlap_trial_steps: 0 always overlaps)")
