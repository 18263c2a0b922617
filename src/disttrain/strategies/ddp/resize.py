"""A DDP checkpoint of N ranks resumed on M: what is kept, what is re-derived, and the
batch rule (the pure part; the store and the launcher call it).

The model and optimizer are every rank's (rank 0's copy stands for all), so they are kept.
The epoch's data is re-split over the new ranks by position, not by rank
(`data.sampler.resplit_state`; the batch rule and the RNG are `training.resize`'s, which
the parameter server shares): the samples each old rank had not yet taken are what the
epoch still owes. The global batch stays the same: each rank takes `B·N/M`, where `B` is
the checkpoint's per-rank batch. What belongs to an old rank cannot be given to a new one:
each new rank's RNG is re-derived from the seed, and compression residuals are dropped.
A run with local updates (each rank's own model within a round) or a balance plan (made
for its ranks) is not resized.
"""

from __future__ import annotations

import logging
from typing import Any

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError
from disttrain.data.sampler import resplit_state
from disttrain.training.resize import rederived_rng, resized_batch_size

logger = logging.getLogger(__name__)


def written_world_size(state: dict[str, Any]) -> int:
    """The number of ranks that wrote a DDP checkpoint (its RNG list holds one per rank)."""
    if "world_size" in state:
        return int(state["world_size"])
    return len(state["rng"]) if isinstance(state.get("rng"), list) else 1


def written_batch_size(state: dict[str, Any]) -> int:
    """The per-rank batch of the run that wrote the checkpoint (its recorded config)."""
    return int(state["config"]["training"]["batch_size"])


def check_resizable(state: dict[str, Any], written: int) -> None:
    """Raises ConfigError when the checkpoint's run cannot be resized (local updates, a
    balance plan)."""
    if "local" in state or "outer" in state:
        raise ConfigError(f"the checkpoint was written with local updates by {written} ranks, whose "
                          f"models differ within a round; resume with --world-size {written}")
    sampler = state.get("sampler", {})
    if "plans" in sampler or "shares" in sampler:
        raise ConfigError(f"the checkpoint holds a balance plan made for {written} ranks; resume "
                          f"with --world-size {written}")


def resize_state(state: dict[str, Any], world_size: int, rank: int, seed: int, batch_size: int
                 ) -> dict[str, Any]:
    """The checkpoint `state` of another number of ranks, as rank `rank` of `world_size`
    loads it. Re-seeds this process's RNGs (rank r of M at step s as
    `training_seed(seed, s·M + r)`: a stream no rank drew before).

    Args:
        batch_size: this run's per-rank batch; it must keep the checkpoint's global batch.

    Raises:
        ConfigError: the run cannot be resized, or `batch_size` does not keep the global batch.
    """
    written = written_world_size(state)
    check_resizable(state, written)
    expected = resized_batch_size(written_batch_size(state), written, world_size)
    if batch_size != expected:
        raise ConfigError(f"training.batch_size: {batch_size} on {world_size} ranks does not keep the "
                          f"checkpoint's global batch of {expected * world_size} ({written} ranks); "
                          f"resume with --batch-size {expected}")
    step = int(state["position"]["step"])
    resized = {key: value for key, value in state.items() if key != "compression"}
    resized["rng"] = rederived_rng(seed, step, world_size, rank)
    ckpt.set_rng_state(resized["rng"])
    resized["sampler"] = resplit_state(state["sampler"], world_size, rank)
    resized["position"], resized["samples_extra"] = spread_samples(state, written, world_size, rank)
    resized["resized_from"] = written
    resized["compression_dropped"] = "compression" in state
    if rank == 0:
        logger.info("resuming %d ranks' checkpoint (step %d) on %d: model and optimizer kept, the "
                    "epoch's remaining samples re-split, each rank's RNG re-derived from the seed",
                    written, step, world_size)
        if "compression" in state:
            logger.info("compression residuals of the %d old ranks dropped: they belong to ranks "
                        "that are gone (error feedback starts again from zero)", written)
    return resized


def spread_samples(state: dict[str, Any], written: int, world_size: int, rank: int
                   ) -> tuple[dict[str, Any], int]:
    """The position with the run's total of samples shared over the new ranks, and rank
    0's extra over the others (the total's remainder over `world_size`; kept in the
    checkpoint as `samples_extra`, so a later resize counts the total again).

    The checkpoint holds rank 0's position; every other rank processed as many samples,
    less rank 0's extra.
    """
    extra = int(state.get("samples_extra", 0))
    total = (int(state["position"]["samples_processed"]) - extra) * written + extra
    extra = total % world_size
    share = total // world_size + (extra if rank == 0 else 0)
    return {**state["position"], "samples_processed": share}, extra


def resumed_config(config: Config) -> Config:
    """The config a resumed run's ranks take: with a checkpoint of another number of ranks
    (or one resized before), the per-rank batch that keeps its global batch. The launcher
    calls it before any rank starts, so a batch that does not divide stops the run there.

    Raises:
        ConfigError: the checkpoint cannot be resized to `system.num_workers` ranks.
        CheckpointError: every checkpoint in the folder is damaged.
    """
    (written, batch_size), world_size = _resumed(config), config.system.num_workers
    if written == world_size and batch_size == config.training.batch_size:
        return config
    logger.info("resuming a checkpoint of %d ranks on %d: per-rank batch %d keeps the global batch "
                "of %d", written, world_size, batch_size, batch_size * world_size)
    return config.replace(training={"batch_size": batch_size})


def resumed_batch_size(config: Config) -> int:
    """The per-rank batch of `resumed_config`, logging nothing: for what is checked
    before the launcher runs (the steps a fault may name).

    Raises:
        ConfigError, CheckpointError: as `resumed_config`.
    """
    return _resumed(config)[1]


def _resumed(config: Config) -> tuple[int, int]:
    """The number of ranks that wrote the newest checkpoint and the per-rank batch this
    run takes (this run's size and batch without a DDP checkpoint, or with one of as many
    ranks never resized)."""
    chosen = ckpt.load_latest_good_checkpoint(config.system.checkpoint_dir)
    if chosen is None or chosen[1].get("strategy") != "ddp":
        return config.system.num_workers, config.training.batch_size
    state, world_size = chosen[1], config.system.num_workers
    written = written_world_size(state)
    if written == world_size and "resized_from" not in state:
        return written, config.training.batch_size
    check_resizable(state, written)
    return written, resized_batch_size(written_batch_size(state), written, world_size)
