"""Re-planning mid-run: when a process's speed drifts from its share of the global batch (a
straggler appears, or recovers), split the next global batches by the new speeds.

Every `interval` steps each process shares its speed over the steps since the last check
(samples over its own work: its waits for peers left out, so a process kept waiting by a
straggler does not look slow), through a collective every process makes at the same
step. From the same speeds each computes the same new plan, and adopts it from the next
batch when it would shorten a step by more than `REPLAN_GAIN`; the sampler keeps the
plans' history, so which samples each block holds stays known (nothing lost, nothing twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.config import SystemConfig, TrainingConfig
from disttrain.coordinator.reports import BalanceState
from disttrain.data import PlannedSampler, ShardedSampler
from disttrain.training.balance import plan_batches, plan_shares

logger = logging.getLogger(__name__)

# A re-plan moves no data and costs nothing but a log line, so it is taken once it
# shortens a step by more than the noise of a speed measured over a few dozen steps.
REPLAN_GAIN = 0.1


def step_time(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """Seconds of a step split by `shares` at `speeds`: the slowest process's."""
    return max(b / s for b, s in zip(shares, speeds, strict=True))


def drifted(current: Sequence[int], planned: Sequence[int], speeds: Sequence[float],
            gain: float = REPLAN_GAIN) -> bool:
    """Whether `planned` beats `current` at `speeds` by more than `gain` of a step."""
    return tuple(planned) != tuple(current) and \
        step_time(current, speeds) > (1 + gain) * step_time(planned, speeds)


class Rebalancer:
    """The speed checks of one process of a balanced run; the loop calls `at_epoch_start()`
    at each epoch's start and `after_step()` after every step.

    Args:
        sampler: this process's sampler; a new plan goes there.
        mode: `proportional` or `auto` (see `plan_batches`).
        margin: `auto`: the gap in speed that turns proportional batches on.
        interval: steps between checks.
        gather: `(name, my speed, step) -> every process's speed` in rank order, or None
            when the check is given up (a process is behind); a collective, `name` unique
            to the step (a barrier's, for the parameter server).
        announce: log each re-plan (the process that speaks for the run).
        warmup_speed: this process's speed measured before training (samples/s; 0: not
            measured), for its balance state.

    `balance` is this process's `BalanceState` (its batch, warm-up speed and plans so far),
    replaced by a new value at each re-plan: another thread (the heartbeats) may read it
    at any time.
    """

    def __init__(self, sampler: PlannedSampler, system: SystemConfig,
                 gather: Callable[[str, float, int], list[float] | None], announce: bool = False,
                 warmup_speed: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        self.sampler, self.mode = sampler, system.balance
        self.margin, self.interval = system.balance_margin, system.balance_interval
        self.gather, self.announce, self.clock = gather, announce, clock
        self.warmup_speed = warmup_speed
        self._since: float | None = None
        self._samples, self._work = 0, 0.0
        self._publish()

    def _publish(self) -> None:
        self.balance = BalanceState(self.sampler.batch_size(), self.warmup_speed, len(self.sampler.plans))

    def restart(self) -> None:
        """Start measuring afresh from now (what came before was not steps)."""
        self._since, self._samples, self._work = self.clock(), 0, 0.0

    def at_epoch_start(self, step: int, epoch: int) -> bool:
        """At an epoch's start: check, if steps were measured since the last check (the
        processes meet at the epoch's end, so asynchronous ones re-plan here too); then
        measure afresh. Returns whether it re-planned."""
        replanned = False
        if self.interval > 0 and self._samples and self.sampler.index == 0:
            replanned = self._check(step, epoch)
        self.restart()
        return replanned

    def after_step(self, step: int, epoch: int, samples: int, blocked_s: float) -> bool:
        """Count a step of `samples` that spent `blocked_s` waiting for peers; at a check,
        gather the speeds and re-plan if they call for it. Returns whether it re-planned."""
        now = self.clock()
        if self._since is not None:
            self._work += max(0.0, now - self._since - blocked_s)
            self._samples += samples
        self._since = now
        if self.interval <= 0 or step % self.interval or self.sampler.exhausted:
            return False
        return self._check(step, epoch)

    def _check(self, step: int, epoch: int) -> bool:
        mine = self._samples / self._work if self._work > 0 else 0.0
        speeds = self.gather(f"speeds@{step}", mine, step)
        self.restart()  # the collective's wait is not work
        current = self.sampler.shares
        if not speeds or min(speeds) <= 0:  # given up (a process is behind), or one not measured
            return False
        planned = plan_batches(speeds, self.sampler.global_batch, self.mode, self.margin)
        if not drifted(current, planned, speeds):
            return False
        self.sampler.replan(planned)
        self._publish()
        message = "re-planned after step %d (epoch %d): speeds %s samples/s, batches %s -> %s"
        args = (step, epoch, ", ".join(f"{s:.0f}" for s in speeds), list(current), planned)
        if self.announce:
            logger.info(message, *args)
        else:
            logger.debug(message, *args)
        return True


@dataclass(frozen=True)
class BalancePeers:
    """The processes that balance together, as one of them sees them.

    Attributes:
        world_size: how many there are.
        rank: this one's rank.
        gather: `(name, value, step) -> every process's value` in rank order (None: the
            check is given up); a collective, `name` unique to the step.
    """

    world_size: int
    rank: int
    gather: Callable[[str, float, int], list[float] | None]


def start_balance(system: SystemConfig, training: TrainingConfig, num_samples: int, peers: BalancePeers,
                  speed: Callable[[], float], announce: str | None = None,
                  ) -> tuple[ShardedSampler | PlannedSampler, Rebalancer | None]:
    """This process's sampler under `system.balance`, and what re-plans it mid-run and
    holds its balance state (None with balance none; with `balance_interval` 0 it never
    re-plans; a plan fixed by `balance_batches` is the first one, re-planned like a
    measured one). A collective: every process of `peers` calls it; `speed()` measures
    this one."""
    world_size, rank, gather = peers.world_size, peers.rank, peers.gather
    shares, mine = plan_shares(system, training.batch_size, world_size,
                               lambda v: gather("speeds", v, 0) or [], speed, announce)
    if shares is None:
        return ShardedSampler(num_samples, world_size=world_size, rank=rank, seed=training.seed), None
    sampler = PlannedSampler(num_samples, world_size=world_size, rank=rank, seed=training.seed,
                             shares=shares)
    return sampler, Rebalancer(sampler, system, gather, announce is not None, mine)


def plan_summary(sampler: ShardedSampler | PlannedSampler | None) -> dict[str, Any]:
    """A run's balance plans as summary fields: `balance_plans` ([epoch, batch, batches]
    of each, the first at [0, 0]) and `balance_replans`; {} with equal batches."""
    if not isinstance(sampler, PlannedSampler):
        return {}
    return {"balance_plans": sampler.state_dict()["plans"], "balance_replans": len(sampler.plans) - 1}
