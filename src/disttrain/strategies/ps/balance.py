"""The workers' balance plan (`system.balance`): each worker's speed, measured before
training on a copy of the model and every `system.balance_interval` steps after, shared
at a barrier on shard 0 (whose answers the servers keep, so a restarted worker that
passes the same step again gets the same plan). A check is given up, for every worker,
when one is behind: a restarted worker redoing steps needs the others' steps to catch up,
and an asynchronous one further back would hold the others."""

from __future__ import annotations

import torch

from disttrain.config import Config
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler
from disttrain.strategies.ps.client import PSClient
from disttrain.training.balance import warmup_speed
from disttrain.training.rebalance import Rebalancer, start_balance


def balance_sampler(config: Config, client: PSClient, worker_id: str, world_size: int, rank: int,
                    train_set: ArrayDataset, faults: FaultInjector, state: dict,
                    ) -> tuple[ShardedSampler | PlannedSampler, Rebalancer | None]:
    """This worker's sampler, and what re-plans it (every worker calls it)."""

    def gather(name: str, speed: float, step: int) -> list[float] | None:
        rows = client.barrier(worker_id, name, [speed], step)  # a check gives up for a worker behind
        return [row[0] for row in rows] if rows else None

    return start_balance(config.system, config.training, len(train_set), world_size, rank, gather,
                         lambda: warmup_speed(config.training, torch.device("cpu"), train_set, faults),
                         announce="worker" if rank == 0 else None, state=state)
