"""The ranks' balance plan (`system.balance`): each rank's speed, measured before training
on a copy of the model (DDP's hooks are not on it), shared by an all-gather of tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.config import Config
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset
from disttrain.strategies.ddp import runtime as rt
from disttrain.training.balance import plan_shares, warmup_speed


def balance_shares(config: Config, runtime: rt.Runtime, train_set: ArrayDataset,
                   faults: FaultInjector) -> tuple[int, ...] | None:
    """Every rank's batch (a collective: every rank calls it), or None for equal batches."""
    info = runtime.info

    def gather(speed: float) -> list[float]:
        mine = torch.tensor([speed], dtype=torch.float64, device=runtime.device)
        gathered = [torch.zeros_like(mine) for _ in range(info.world_size)]
        dist.all_gather(gathered, mine)
        return [float(t.item()) for t in gathered]

    return plan_shares(config.system, config.training.batch_size, info.world_size, gather,
                       lambda: warmup_speed(config.training, runtime.device, train_set, faults),
                       announce="rank" if info.is_main else None)
