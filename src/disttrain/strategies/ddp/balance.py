"""The ranks' balance plan (`system.balance`): each rank's speed, measured before training
on a copy of the model (DDP's hooks are not on it) and every `system.balance_interval`
steps after, shared by an all-gather of tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.config import SystemConfig, TrainingConfig
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler
from disttrain.strategies.ddp import runtime as rt
from disttrain.training.balance import warmup_speed
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
