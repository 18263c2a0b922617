"""The ranks' balance plan: each rank's speed, measured before training on a copy of the
model, shared by an all-gather of tensors, and the same batches computed on every rank
(`training.balance`). None when every rank keeps the config's batch."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from disttrain.config import Config
from disttrain.core.errors import ConfigError
from disttrain.core.faults import FaultInjector
from disttrain.data import ArrayDataset
from disttrain.strategies.ddp import runtime as rt
from disttrain.training.balance import measure_speed, plan_batches
from disttrain.training.engine import forward_backward
from disttrain.training.models import init_model

logger = logging.getLogger(__name__)


def balance_shares(config: Config, runtime: rt.Runtime, train_set: ArrayDataset,
                   faults: FaultInjector) -> tuple[int, ...] | None:
    """Every rank's batch under `system.balance` (a collective: every rank calls it), or
    None when the plan is the config's equal batches."""
    system, training, info = config.system, config.training, runtime.info
    if system.balance == "none":
        return None
    if system.balance_batches:
        return fixed_shares(system.balance_batches, training.batch_size * info.world_size, info.world_size)
    model = init_model(training).to(runtime.device)  # a copy: DDP's hooks are not on it
    inputs, targets = train_set.batch(torch.arange(min(training.batch_size, len(train_set))))
    inputs, targets = inputs.to(runtime.device), targets.to(runtime.device)

    def one_pass() -> int:
        forward_backward(model, inputs, targets)
        model.zero_grad(set_to_none=True)
        return len(targets)

    mine = torch.tensor([measure_speed(one_pass, faults)], dtype=torch.float64, device=runtime.device)
    gathered = [torch.zeros_like(mine) for _ in range(info.world_size)]
    dist.all_gather(gathered, mine)
    speeds = [float(t.item()) for t in gathered]
    shares = plan_batches(speeds, training.batch_size * info.world_size, system.balance,
                          system.balance_margin)
    if info.is_main:
        logger.info("rank speeds %s samples/s: batches %s (balance %s)",
                    ", ".join(f"{s:.0f}" for s in speeds), shares, system.balance)
    return None if len(set(shares)) == 1 else tuple(shares)


def fixed_shares(text: str, global_batch: int, world_size: int) -> tuple[int, ...]:
    """The plan of `system.balance_batches` ("48,16").

    Raises:
        ConfigError: not one batch per rank, or not summing to the global batch.
    """
    shares = tuple(int(part) for part in text.split(","))
    if len(shares) != world_size or sum(shares) != global_batch:
        raise ConfigError(f"system.balance_batches: {text} gives {len(shares)} batches of {sum(shares)} "
                          f"samples in all; give {world_size}, summing to the global batch "
                          f"{global_batch} (training.batch_size x the world size)")
    return shares
