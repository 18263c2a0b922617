"""Data blocks: the unit the servers' ledgers count. Block `(epoch * workers + rank) *
batches_per_epoch + index` is worker `rank`'s batch `index` of `epoch`, unique in the run.
Which samples it holds comes from the worker's sampler: a slice of its equal shard, or its
piece of a global batch under the balance plan in force at that batch."""

from __future__ import annotations

import copy

import torch

from disttrain.data import PlannedSampler, ShardedSampler

Sampler = ShardedSampler | PlannedSampler


def block_id(epoch: int, rank: int, index: int, world_size: int, batches_per_epoch: int) -> int:
    return (epoch * world_size + rank) * batches_per_epoch + index


def block_place(block: int, world_size: int, batches_per_epoch: int) -> tuple[int, int, int]:
    """(epoch, rank, index) of `block`."""
    epoch_rank, index = divmod(block, batches_per_epoch)
    epoch, rank = divmod(epoch_rank, world_size)
    return epoch, rank, index


def block_length(sampler: Sampler, batch_size: int, block: int) -> int:
    """Samples in `block` (any worker's), `batch_size` being the config's batch."""
    bpe = sampler.num_batches(batch_size)
    epoch, rank, index = block_place(block, sampler.world_size, bpe)
    if isinstance(sampler, PlannedSampler):
        return sampler.shares_at(epoch, index)[rank]
    return min(batch_size, len(sampler) - index * batch_size)


def block_indices(sampler: Sampler, batch_size: int, epoch: int, index: int, rank: int | None = None
                  ) -> torch.Tensor:
    """The sample indices of batch `index` of `epoch` of worker `rank` (default: this
    worker's, the sampler's own rank)."""
    if isinstance(sampler, PlannedSampler):
        return sampler.block(epoch, index, rank)
    if rank is not None and rank != sampler.rank:  # the same split (a re-split epoch's too), seen from `rank`
        sampler = copy.copy(sampler)
        sampler.rank = rank
    return sampler.shard(epoch)[index * batch_size:(index + 1) * batch_size]
