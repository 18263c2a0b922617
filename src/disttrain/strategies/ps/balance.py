"""The workers' balance plan (`system.balance`): each worker's speed, measured before
training on a copy of the model, shared at a barrier on shard 0 (whose answer the
servers keep, so a restarted worker gets the same plan)."""

from __future__ import annotations

import torch

from disttrain.config import Config
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset
from disttrain.strategies.ps.client import PSClient
from disttrain.training.balance import plan_shares, warmup_speed


def balance_shares(config: Config, client: PSClient, worker_id: str, world_size: int, rank: int,
                   train_set: ArrayDataset, faults: FaultInjector) -> tuple[int, ...] | None:
    """Every worker's batch (every worker calls it), or None for equal batches."""

    def gather(speed: float) -> list[float]:
        return [row[0] for row in client.barrier(worker_id, "speeds", [speed])]

    return plan_shares(config.system, config.training.batch_size, world_size, gather,
                       lambda: warmup_speed(config.training, torch.device("cpu"), train_set, faults),
                       announce="worker" if rank == 0 else None)
