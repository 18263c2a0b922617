"""What a DDP checkpoint holds, and how every rank restores from it.

Rank 0 writes it; all ranks read it. Model and optimizer are the same on every rank
after each step, so rank 0's copy (the model without its DDP wrapper, so the file loads
into a plain module) stands for all. The sampler position is the same on every rank
too (equal shards, equal batches). The RNG states differ per rank and are all kept.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from disttrain import checkpoint as ckpt
from disttrain.baseline import Position
from disttrain.config import Config
from disttrain.data import ShardedSampler
from disttrain.ddp.precision import Precision
from disttrain.errors import CheckpointError

logger = logging.getLogger(__name__)

STRATEGY = "ddp"
REQUIRED_KEYS = ("world_size", "model", "optimizer", "grad_scaler", "sampler", "rng",
                 "epoch", "step", "samples_processed", "train_time_s")


def build_state(config: Config, model: nn.Module, optimizer, sampler: ShardedSampler,
                precision: Precision, position: Position, rng_states: list[dict[str, Any]]
                ) -> dict[str, Any]:
    """The checkpoint dict (rank 0 calls this after `gather_rng_states`).

    Args:
        model: the module inside the DDP wrapper.
        rng_states: every rank's RNG state, in rank order.
    """
    return {
        "strategy": STRATEGY,
        "world_size": len(rng_states),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "grad_scaler": precision.state_dict(),
        "epoch": position.epoch,
        "step": position.step,
        "samples_processed": position.samples_processed,
        "train_time_s": position.train_time_s,
        "sampler": sampler.state_dict(),
        "rng": rng_states,
        "config": config.to_dict(),
    }


def restore(path: Path, rank: int, world_size: int, model: nn.Module, optimizer,
            sampler: ShardedSampler, precision: Precision) -> Position:
    """Load the checkpoint at `path` into this rank's model, optimizer, sampler, scaler and RNG.

    Call before wrapping the model in DDP (whose construction broadcasts rank 0's weights).

    Raises:
        CheckpointError: unreadable, from another strategy or world size, or not fitting the model.
    """
    state = ckpt.load_strategy_checkpoint(path, STRATEGY, REQUIRED_KEYS)
    if int(state["world_size"]) != world_size or len(state["rng"]) != world_size:
        raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} ranks and this "
                              f"run has {world_size}; resume with --world-size {state['world_size']}")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        precision.load_state_dict(state["grad_scaler"])
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this run: {first}") from e
    ckpt.set_rng_state(state["rng"][rank])
    logger.info("resumed from %s (epoch %d, step %d)", path, state["epoch"], state["step"])
    return Position(epoch=int(state["epoch"]), step=int(state["step"]),
                    samples_processed=int(state["samples_processed"]),
                    train_time_s=float(state["train_time_s"]))
