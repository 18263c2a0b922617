"""The sampler of a balanced run: the global batches are fixed, and a plan says only how
each is split between the processes.

Each epoch's permutation (the same as `ShardedSampler`'s, from `(seed, epoch)` alone) is
cut, in order, into `num_samples // global_batch` global batches (the tail is left out of
that epoch; the next permutation puts other samples there). Global batch `i` is cut into
consecutive pieces, one per rank in rank order, of the sizes of the plan in force at `i`.

A re-plan (`replan`) takes effect at the next batch. Which samples make each global batch
never changes, so a synchronous step sees the same samples whatever the plan (one process
stepping on the global batches is the reference), every rank takes the same number of
steps, and no sample is left out or taken twice. The plans' history is part of the
state: it names the samples of every block of the run, for a resume or a redo.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from disttrain.data.sampler import check_shard_sizes, epoch_permutation
from disttrain.data.shard_order import checked_sizes

Plan = tuple[int, int, tuple[int, ...]]  # (epoch, batch index, each rank's batch) from then on


class PlannedSampler:
    """Rank `rank`'s pieces of the global batches, split by a plan that may change.

    Call `set_epoch(e)` at the start of each epoch, then iterate `batches()`; `replan()`
    between two batches changes the split from the next one on. A data set read shard by
    shard is told its shards' sizes by `read_by_shards` before the first epoch (as the
    training loop does for either sampler).
    """

    def __init__(self, num_samples: int, *, world_size: int, rank: int, seed: int = 0,
                 shares: Sequence[int], shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.num_samples, self.world_size, self.rank = num_samples, world_size, rank
        self.seed, self.shuffle = seed, shuffle
        shares = self._checked(shares, sum(shares))
        self.global_batch = sum(shares)
        self.plans: list[Plan] = [(0, 0, shares)]
        self.epoch = 0
        self.index = 0  # batches of this epoch handed out
        self._order: tuple[int, torch.Tensor] | None = None
        self.shard_sizes: tuple[int, ...] | None = None

    def read_by_shards(self, shard_sizes: Sequence[int]) -> None:
        """Order each epoch shard by shard (`data.shard_order`), as `ShardedSampler` does."""
        self.shard_sizes = checked_sizes(shard_sizes, self.num_samples)
        self._order = None

    def _checked(self, shares: Sequence[int], global_batch: int) -> tuple[int, ...]:
        shares = tuple(int(s) for s in shares)
        if (len(shares) != self.world_size or min(shares) < 1 or sum(shares) != global_batch
                or global_batch > self.num_samples):
            raise ValueError(f"batches {list(shares)} do not split a global batch of {global_batch} "
                             f"out of {self.num_samples} samples over {self.world_size} ranks")
        return shares

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    @property
    def exhausted(self) -> bool:
        """Whether this epoch's batches have all been handed out."""
        return self.index >= self.steps_per_epoch

    def shares_at(self, epoch: int, index: int) -> tuple[int, ...]:
        """Every rank's batch at batch `index` of `epoch`."""
        shares = self.plans[0][2]
        for at_epoch, at_index, planned in self.plans:
            if (at_epoch, at_index) > (epoch, index):
                break
            shares = planned
        return shares

    @property
    def shares(self) -> tuple[int, ...]:
        """Every rank's batch at the next batch."""
        return self.shares_at(self.epoch, self.index)

    def batch_size(self, default: int = 0) -> int:
        """This rank's batch at the next batch (`default` is not used: the plan decides)."""
        return self.shares[self.rank]

    def num_batches(self, batch_size: int = 0, drop_last: bool = False) -> int:
        return self.steps_per_epoch

    def next_index(self, batch_size: int = 0) -> int:
        return self.index

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch`; entering a new epoch starts at its beginning."""
        if epoch != self.epoch:
            self.epoch, self.index = epoch, 0

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            order = epoch_permutation(self.num_samples, self.seed, epoch, self.shard_sizes) if self.shuffle \
                else torch.arange(self.num_samples)
            self._order = (epoch, order)
        return self._order[1]

    def block(self, epoch: int, index: int, rank: int | None = None) -> torch.Tensor:
        """The sample indices of `rank`'s (default: this rank's) batch `index` of `epoch`."""
        rank = self.rank if rank is None else rank
        shares = self.shares_at(epoch, index)
        start = index * self.global_batch + sum(shares[:rank])
        return self._permutation(epoch)[start:start + shares[rank]]

    def batches(self, batch_size: int = 0, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """Yield the remaining batches of the epoch, each split by the plan in force when it
        is handed out, advancing the position with each."""
        while not self.exhausted:
            batch = self.block(self.epoch, self.index)
            self.index += 1
            yield batch

    def replan(self, shares: Sequence[int]) -> bool:
        """Split the global batches by `shares` from the next batch on (the next epoch's
        first, when this one is over); False when that is the plan already.

        Raises:
            ValueError: `shares` do not split the global batch over the ranks.
        """
        shares = self._checked(shares, self.global_batch)
        if shares == self.shares:
            return False
        at = (self.epoch + 1, 0) if self.exhausted else (self.epoch, self.index)
        self.plans = [p for p in self.plans if (p[0], p[1]) < at] + [(*at, shares)]
        return True

    def state_dict(self) -> dict[str, Any]:
        state = {"num_samples": self.num_samples, "world_size": self.world_size, "rank": self.rank,
                 "seed": self.seed, "epoch": self.epoch, "position": self.index,
                 "plans": [[e, i, list(s)] for e, i, s in self.plans]}
        if self.shard_sizes is not None:
            state["shard_sizes"] = list(self.shard_sizes)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position and the plans so far (another rank's too: DDP saves rank 0's).

        Raises:
            ValueError: the state belongs to a different data set, layout or seed, or to a
                run without a balance plan.
        """
        for key in ("num_samples", "world_size", "seed"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={int(state[key])} but this run has "
                                 f"{getattr(self, key)}; resume with the same data, workers and seed")
        if "plans" not in state:
            raise ValueError("sampler state has no balance plan but this run has one; resume with "
                             "system.balance: none")
        check_shard_sizes(state, self.shard_sizes)
        plans = [(int(e), int(i), tuple(int(s) for s in shares)) for e, i, shares in state["plans"]]
        global_batch = sum(plans[0][2])
        plans = [(e, i, self._checked(shares, global_batch)) for e, i, shares in plans]
        position = int(state["position"])
        if not 0 <= position <= self.num_samples // global_batch:
            raise ValueError(f"sampler position {position} is outside [0, "
                             f"{self.num_samples // global_batch}] batches")
        self.global_batch, self.plans = global_batch, plans
        self.epoch, self.index = int(state["epoch"]), position
