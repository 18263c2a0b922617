"""The sharded, resumable sampler every strategy draws its batches from.

Each epoch has one permutation of the data set, derived from `(seed, epoch)` alone, cut
into `world_size` non-overlapping shards of equal length (the tail that does not divide
evenly is left out of that epoch; the next permutation puts other samples there). A
sampler remembers how far into its shard it has gone, so a run resumed from its
`state_dict()` continues at the next sample: none repeated, none skipped.

A run that splits its batches by speed (`system.balance`) draws from `PlannedSampler`
(`data.planned`) instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Large odd constant so (seed, epoch) pairs never collide for realistic values.
_EPOCH_STRIDE = 1_000_003


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * _EPOCH_STRIDE + epoch)
    return torch.randperm(num_samples, generator=gen)


class ShardedSampler:
    """Batches of sample indices for one rank (or worker) of `world_size`.

    Call `set_epoch(e)` at the start of each epoch, then iterate `batches(batch_size)`.
    The position advances when a batch is handed out, so a checkpoint written after that
    batch's step records it as consumed.
    """

    def __init__(self, num_samples: int, *, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot be split into {world_size} non-empty "
                             "shards; use fewer workers or more data")
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Samples in this rank's shard per epoch."""
        return self.num_samples // self.world_size

    def batch_size(self, default: int) -> int:
        """This rank's batch: `default` (a balanced run's sampler decides it by its plan)."""
        return default

    def next_index(self, batch_size: int) -> int:
        """The index in the epoch of the next batch of `batch_size`."""
        return self.position // batch_size

    @property
    def exhausted(self) -> bool:
        """Whether this epoch's shard has all been handed out."""
        return self.position >= len(self)

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch`. Entering a new epoch starts at its beginning; setting the epoch
        the sampler already holds (after a resume) keeps the restored position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        """All indices of this rank's shard for `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            order = epoch_permutation(self.num_samples, self.seed, epoch)
        else:
            order = torch.arange(self.num_samples)
        length = len(self)
        return order[self.rank * length:(self.rank + 1) * length]

    def consumed(self) -> torch.Tensor:
        """Indices of this epoch already handed out."""
        return self.shard()[: self.position]

    def remaining(self) -> torch.Tensor:
        """Indices of this epoch not yet handed out, in the order they will come."""
        return self.shard()[self.position:]

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        full, rest = divmod(len(self), batch_size)
        return full if drop_last or not rest else full + 1

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """Yield the remaining batches of the epoch, advancing the position with each."""
        shard = self.shard()
        while self.position < len(shard):
            batch = shard[self.position:self.position + batch_size]
            if drop_last and len(batch) < batch_size:
                return
            self.position += len(batch)
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"num_samples": self.num_samples, "world_size": self.world_size, "rank": self.rank,
                "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position (another rank's too: DDP saves rank 0's). The data set size,
        world size and seed must match, or the saved position would name other samples.

        Raises:
            ValueError: the state belongs to a different data set, layout or seed.
        """
        for key in ("num_samples", "world_size", "seed"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={int(state[key])} but this run has "
                                 f"{getattr(self, key)}; resume with the same data, workers and seed")
        if "plans" in state or "shares" in state:
            raise ValueError("sampler state has a balance plan but this run has none; resume with "
                             "the run's system.balance")
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"sampler position {position} is outside [0, {len(self)}]")
        self.epoch = int(state["epoch"])
        self.position = position
