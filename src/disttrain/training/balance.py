"""Work in proportion to each process's speed: measure it before training, and split
every global batch by it.

Each process times a few forward and backward passes of one batch (after an untimed
one), slowed as the run's `slow` fault slows its steps, and the processes share their
speeds (DDP: an all-gather). From the same speeds every process computes the same plan:
the batch of each, summing to the global batch (the config's batch size times the
processes), so each step still sees the same samples in all. Ranks take equal numbers of
steps per epoch; their losses are weighted by their share of the step's samples, so the
averaged gradient is the gradient of the whole global batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from disttrain.core.faults import FaultInjector

WARMUP_PASSES = 3


def measure_speed(compute: Callable[[], int], faults: FaultInjector | None = None,
                  passes: int = WARMUP_PASSES, clock: Callable[[], float] = time.perf_counter) -> float:
    """Samples per second of `compute` (one forward and backward; returns its samples),
    timed over `passes` calls after one untimed call."""
    compute()  # allocations and caches, left out
    samples, started = 0, clock()
    for _ in range(passes):
        samples += compute()
    elapsed = clock() - started
    if faults is not None:
        elapsed += faults.straggle_for(elapsed)
    return samples / max(elapsed, 1e-9)


def plan_batches(speeds: Sequence[float], global_batch: int, mode: str, margin: float) -> list[int]:
    """Each process's batch, summing to `global_batch`.

    `none` (or `auto` while the slowest is within `margin` of the fastest): equal, the
    remainder to the first processes. `proportional` (and `auto` past the margin): in
    proportion to speed, by largest remainders, at least one sample each.

    Raises:
        ValueError: an unknown mode, no speeds, a speed that is not positive, or fewer
            samples than processes.
    """
    count = len(speeds)
    if mode not in ("none", "proportional", "auto"):
        raise ValueError(f"unknown balance {mode!r}; use none, proportional or auto")
    if not count or min(speeds) <= 0 or global_batch < count:
        raise ValueError(f"cannot split {global_batch} samples by speeds {list(speeds)}")
    if mode == "none" or (mode == "auto" and min(speeds) >= (1 - margin) * max(speeds)):
        base, extra = divmod(global_batch, count)
        return [base + (1 if i < extra else 0) for i in range(count)]
    spare = global_batch - count  # one sample each first, the rest by speed
    exact = [spare * s / sum(speeds) for s in speeds]
    batches = [1 + int(e) for e in exact]
    by_remainder = sorted(range(count), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[:global_batch - sum(batches)]:
        batches[i] += 1
    return batches
