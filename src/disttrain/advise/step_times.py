"""How long one worker's step computes, as a distribution the simulation draws from:
constant, a log-normal tail, a share of stragglers several times slower, failures."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepTimes:
    """One worker's compute per step.

    Args:
        mean_s: the typical step (the log-normal's median when `lognormal_sigma` > 0).
        lognormal_sigma: sigma of a log-normal factor on each step (0: constant).
        straggler_fraction: share of the workers that are stragglers, for the whole run.
        straggler_factor: how many times slower a straggler's steps are.
        failure_rate: probability that a worker fails during a step (its step is lost).
        detect_s: seconds until a failed worker leaves the synchronous quorum (the
            heartbeat timeout).
        restart_s: seconds until a failed worker is back (at least `detect_s`).
    """

    mean_s: float
    lognormal_sigma: float = 0.0
    straggler_fraction: float = 0.0
    straggler_factor: float = 3.0
    failure_rate: float = 0.0
    detect_s: float = 5.0
    restart_s: float = 10.0

    def __post_init__(self) -> None:
        problems = []
        if not self.mean_s > 0:
            problems.append(f"mean step time {self.mean_s} must be > 0")
        if self.lognormal_sigma < 0:
            problems.append(f"log-normal sigma {self.lognormal_sigma} must be >= 0")
        if not 0 <= self.straggler_fraction <= 1:
            problems.append(f"straggler fraction {self.straggler_fraction} must be in [0, 1]")
        if self.straggler_factor < 1:
            problems.append(f"straggler factor {self.straggler_factor} must be >= 1")
        if not 0 <= self.failure_rate < 1:
            problems.append(f"failure rate {self.failure_rate} must be in [0, 1)")
        if not 0 <= self.detect_s <= self.restart_s:
            problems.append(f"detection ({self.detect_s} s) must come before the restart "
                            f"({self.restart_s} s)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_constant(self) -> bool:
        return self.lognormal_sigma == 0 and self.straggler_fraction == 0 and self.failure_rate == 0

    def stragglers(self, num_workers: int, rng: random.Random) -> set[int]:
        """Which workers are stragglers: round(fraction · n) of them, drawn."""
        count = round(self.straggler_fraction * num_workers)
        return set(rng.sample(range(num_workers), count))

    def draw(self, rng: random.Random, straggler: bool) -> float:
        """One step's compute, in seconds."""
        value = self.mean_s
        if self.lognormal_sigma:
            value *= math.exp(rng.gauss(0.0, self.lognormal_sigma))
        return value * self.straggler_factor if straggler else value

    def fails(self, rng: random.Random) -> bool:
        return self.failure_rate > 0 and rng.random() < self.failure_rate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
