"""The order of an epoch over a data set read shard by shard: the shards shuffled, and the
samples within each shard shuffled, from `(seed, epoch)` alone (as WebDataset and MosaicML
streaming order theirs).

The order is a permutation of every sample, so the sampler cuts it into ranks' parts,
positions and re-split lists exactly as it does a plain permutation: every sample once per
epoch, and a resume at any position goes on with the rest. What it adds is locality: each
shard's samples are consecutive in it, so a rank's contiguous part of the epoch reads only
the shards that part covers (about `num_shards / world_size + 1`), each once, whole, in an
order the rank knows ahead (what the shard reader prefetches).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# Large odd constant so (seed, epoch) pairs never collide for realistic values.
EPOCH_STRIDE = 1_000_003


def checked_sizes(shard_sizes: Sequence[int], num_samples: int) -> tuple[int, ...]:
    """`shard_sizes` as a tuple of positive ints summing to `num_samples`.

    Raises:
        ValueError: an empty or negative size, or a sum other than `num_samples`.
    """
    sizes = tuple(int(n) for n in shard_sizes)
    if not sizes or min(sizes) < 1 or sum(sizes) != num_samples:
        raise ValueError(f"shard sizes {list(sizes[:8])}{'...' if len(sizes) > 8 else ''} are not positive "
                         f"sizes summing to the data set's {num_samples} samples")
    return sizes


def shard_permutation(shard_sizes: Sequence[int], seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of the samples of shards of `shard_sizes` (sample `i` of shard `s`
    is index `sum(shard_sizes[:s]) + i`): the shards in a random order, each shard's samples
    consecutive and in a random order of their own.

    Vectorised: every sample's key is (its shard's place, a random rank among all), so one
    sort orders a corpus of millions of samples without a loop over shards. The last few
    orders are kept (a parameter-server worker asks for its epoch's at every block); each
    call gets its own copy.
    """
    return _ordered(tuple(int(n) for n in shard_sizes), int(seed), int(epoch)).clone()


@functools.lru_cache(maxsize=4)
def _ordered(shard_sizes: tuple[int, ...], seed: int, epoch: int) -> torch.Tensor:
    sizes = torch.as_tensor(shard_sizes, dtype=torch.int64)
    num_samples = int(sizes.sum())
    gen = torch.Generator().manual_seed(seed * EPOCH_STRIDE + epoch)
    place = torch.empty(len(sizes), dtype=torch.int64)
    place[torch.randperm(len(sizes), generator=gen)] = torch.arange(len(sizes))
    shard_of = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    keys = place[shard_of] * num_samples + torch.randperm(num_samples, generator=gen)
    return torch.argsort(keys)


def shard_starts(shard_sizes: Sequence[int]) -> torch.Tensor:
    """The first index of each shard, and the data set's length last: `searchsorted(starts,
    i, right=True) - 1` is the shard of index `i`."""
    return torch.cumsum(torch.as_tensor([0, *(int(n) for n in shard_sizes)], dtype=torch.int64), 0)
