"""A run's checkpoint of N workers (or ranks) resumed on M: the pieces every strategy
shares (DDP's `strategies.ddp.resize`, the parameter server's `strategies.ps.run.resize`).

- The batch rule: the global batch stays the same, each of the M takes `B·N/M`, where
  `B` is the checkpoint's per-worker batch; a global batch that does not divide over M is
  refused, naming the sizes that keep it.
- Each new worker's RNG, re-derived from the seed (`rederived_rng`): what belonged to an
  old worker cannot be given to a new one.

The epoch's data is re-split by `data.sampler.resplit_state`.
"""

from __future__ import annotations

from typing import Any

from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError
from disttrain.training.seeding import seed_training

# How many of the sizes that keep a global batch an error names.
_NUM_SIZES_NAMED = 8


def resized_batch_size(batch_size: int, written: int, world_size: int, flag: str = "--world-size",
                       noun: str = "ranks") -> int:
    """The per-worker batch that keeps the global batch of `written` workers of
    `batch_size` on `world_size` workers.

    Args:
        flag, noun: how the error names the option that sets the size, and the workers.

    Raises:
        ConfigError: the global batch does not divide over `world_size`.
    """
    global_batch = batch_size * written
    if global_batch % world_size:
        sizes = [n for n in range(1, global_batch + 1) if global_batch % n == 0][:_NUM_SIZES_NAMED]
        raise ConfigError(f"system.num_workers: the checkpoint's global batch of {global_batch} "
                          f"({written} {noun} x {batch_size}) does not divide over {world_size} {noun}; "
                          f"resume with {flag} in {', '.join(map(str, sizes))}"
                          f"{', ...' if len(sizes) == _NUM_SIZES_NAMED else ''} (each keeps it)")
    return global_batch // world_size


def rederived_rng(seed: int, step: int, world_size: int, rank: int) -> dict[str, Any]:
    """The RNG state of rank `rank` of `world_size` resumed at `step` after a resize:
    `training_seed(seed, step·M + rank)`, a stream no worker drew before. This process's
    own RNGs are left as they were."""
    own = ckpt.rng_state()
    seed_training(seed, step * world_size + rank)
    derived = ckpt.rng_state()
    ckpt.set_rng_state(own)
    return derived
