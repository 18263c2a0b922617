"""The ranks' balance plan (`system.balance`) under both recovery policies: each rank's
speed, shared by an all-gather of tensors.

Restart mode (`balance_sampler`): measured before training on a copy of the model (DDP's
hooks are not on it) and every `system.balance_interval` steps after.

A live group (`LiveBalance`): at a change of group the members share the speeds of their
last checks and split the global batches by them (`plan_batches`), or evenly while one has
none yet (a joiner, or the run's start); then every interval they measure again (their own
work only: the waits for peers are left out) and re-plan when a new split would shorten a
step (`Rebalancer`, as restart mode does). A generation's first step is not measured: a
joiner's (the model's first forward, its caches) would make it look slow. Whatever the
split, a step trains on the same global batches, so no plan loses or repeats a sample."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from disttrain.config import SystemConfig, TrainingConfig
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler
from disttrain.strategies.ddp import runtime as rt
from disttrain.training.balance import plan_batches, warmup_speed
from disttrain.training.rebalance import BalancePeers, Rebalancer, start_balance


def gather_speeds(speed: float, world_size: int, device: torch.device | None = None) -> list[float]:
    """Every rank's `speed` in rank order, by an all-gather of one float each (a
    collective; gloo gathers host tensors, NCCL the rank's GPU's)."""
    mine = torch.tensor([speed], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return [float(t.item()) for t in gathered]


def balance_sampler(system: SystemConfig, training: TrainingConfig, runtime: rt.Runtime,
                    train_set: ArrayDataset, faults: FaultInjector,
                    ) -> tuple[ShardedSampler | PlannedSampler, Rebalancer | None]:
    """This rank's sampler, and what re-plans it and holds its balance state (a
    collective: every rank calls it)."""
    info = runtime.info
    # gloo gathers host tensors; NCCL needs them on the rank's GPU
    device = runtime.device if runtime.backend == "nccl" else torch.device("cpu")

    def gather(name: str, speed: float, step: int) -> list[float]:
        return gather_speeds(speed, info.world_size, device)

    return start_balance(system, training, len(train_set), BalancePeers(info.world_size, info.rank, gather),
                         lambda: warmup_speed(training, runtime.device, train_set, faults),
                         announce="rank" if info.is_main else None)


class LiveBalance:
    """One member's speeds and the current generation's checks.

    Args:
        system: the run's `system` settings (`balance` other than none).
        global_batch: samples per global batch.
    """

    def __init__(self, system: SystemConfig, global_batch: int):
        self.system, self.global_batch = system, global_batch
        self.speed = 0.0  # samples/s at this member's last check (0: not measured yet)
        self.rebalancer: Rebalancer | None = None  # this generation's checks

    def shares(self, world_size: int) -> tuple[int, ...] | None:
        """The split by the members' last speeds, or None (even) while one has none. A
        collective: every member calls it when a generation starts."""
        speeds = self._gather("speeds", self.speed, 0)
        if len(speeds) != world_size or min(speeds) <= 0:
            return None
        system = self.system
        return tuple(plan_batches(speeds, self.global_batch, system.balance, system.balance_margin))

    def start(self, sampler: PlannedSampler, rank: int, clock: Callable[[], float]) -> None:
        """Check `sampler`'s generation every interval (rank 0 logs each re-plan), timing
        the work on `clock`: the member's training clock, which stops for evaluations and
        checkpoint writes (and the faults meant for them), so none counts as work."""
        system = self.system
        self.rebalancer = Rebalancer(sampler, system, self._gather, rank == 0, self.speed, clock=clock)

    def stop(self) -> None:
        """The generation is gone."""
        self.rebalancer = None

    def restart(self) -> None:
        """Measure afresh from now (what came before was not training: an evaluation)."""
        if self.rebalancer is not None:
            self.rebalancer.restart()

    def after_step(self, step: int, epoch: int, samples: int, waited_s: float) -> bool:
        """Count a step of `samples` that waited `waited_s` for peers; at a check, re-plan
        (a collective). Returns whether it re-planned."""
        if self.rebalancer is None:
            return False
        return self.rebalancer.after_step(step, epoch, samples, waited_s)

    def _gather(self, name: str, speed: float, step: int) -> list[float]:
        """Every member's speed in rank order (a collective); `speed` is this member's."""
        if speed > 0:
            self.speed = speed
        return gather_speeds(speed, dist.get_world_size())
