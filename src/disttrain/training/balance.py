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

import logging
import time
from collections.abc import Callable, Sequence

import torch

from disttrain.config import SystemConfig, TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset
from disttrain.training.engine import forward_backward, to_device
from disttrain.training.models import init_model

logger = logging.getLogger(__name__)

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


def warmup_speed(training: TrainingConfig, device: torch.device, train_set: ArrayDataset,
                 faults: FaultInjector | None = None) -> float:
    """This process's samples/s on one batch of the config's size, timed on a fresh copy
    of the model (`measure_speed`), on `device`."""
    model = init_model(training).to(device)
    inputs, targets = train_set.batch(torch.arange(min(training.batch_size, len(train_set))))
    inputs, targets = to_device(inputs, device), targets.to(device)

    def one_pass() -> int:
        forward_backward(model, inputs, targets)
        model.zero_grad(set_to_none=True)
        return len(targets)

    return measure_speed(one_pass, faults)


def fixed_shares(text: str, global_batch: int, world_size: int) -> tuple[int, ...]:
    """The plan of `system.balance_batches` ("48,16").

    Raises:
        ConfigError: not one batch per process, or not summing to the global batch.
    """
    shares = tuple(int(part) for part in text.split(","))
    if len(shares) != world_size or sum(shares) != global_batch:
        raise ConfigError(f"system.balance_batches: {text} gives {len(shares)} batches of {sum(shares)} "
                          f"samples in all; give {world_size}, summing to the global batch "
                          f"{global_batch} (training.batch_size x the processes)")
    return shares


def plan_shares(system: SystemConfig, batch_size: int, world_size: int,
                gather: Callable[[float], list[float]], speed: Callable[[], float],
                announce: str | None = None) -> tuple[tuple[int, ...] | None, float]:
    """The run's first plan under `system.balance`, and this process's warm-up speed (0
    when not measured): each process's batch, or None for the config's equal batches of
    `batch_size` (balance none). `speed()` measures this process, `gather(speed)` returns
    every process's, in rank order (a collective). `announce` ("rank", "worker"): log the
    speeds and the plan under that name (the process that speaks for the run)."""
    global_batch = batch_size * world_size
    if system.balance == "none":
        return None, 0.0
    if system.balance_batches:
        return fixed_shares(system.balance_batches, global_batch, world_size), 0.0
    mine = speed()
    speeds = gather(mine)
    shares = plan_batches(speeds, global_batch, system.balance, system.balance_margin)
    if announce:
        logger.info("%s speeds %s samples/s: batches %s (balance %s)", announce,
                    ", ".join(f"{s:.0f}" for s in speeds), shares, system.balance)
    return tuple(shares), mine
