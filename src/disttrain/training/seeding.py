"""The one seeding rule of every strategy.

The model's initial weights come from `training.seed` alone, so every process of a run
(and every strategy) starts from the same parameters. Then each process reseeds its
training RNG (dropout masks) with `training_seed(seed, rank)`: rank r of N draws its
masks the same way whatever the strategy, so the baseline, one parameter-server worker
in sync mode and one DDP rank end with the same parameters.
"""

from __future__ import annotations

import random

import numpy as np
import torch

# Keeps rank seeds apart from the init seed of any other run's seed (seed + rank would
# make rank 1 of seed 42 draw what rank 0 of seed 43 draws).
_RANK_STRIDE = 1_000_003


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (and CUDA when present)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def training_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s training RNG (rank 0's is `seed` itself)."""
    return seed + rank * _RANK_STRIDE


def seed_training(seed: int, rank: int = 0) -> None:
    """Reseed every RNG for training as rank `rank`; call once the model is built."""
    seed_everything(training_seed(seed, rank))
