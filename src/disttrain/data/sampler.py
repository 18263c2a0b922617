"""The sharded, resumable sampler every strategy draws its batches from.

Each epoch has one permutation of the data set, derived from `(seed, epoch)` alone, cut
into `world_size` non-overlapping shards of equal length (the tail that does not divide
evenly is left out of that epoch; the next permutation puts other samples there). A
sampler remembers how far into its shard it has gone, so a run resumed from its
`state_dict()` continues at the next sample: none repeated, none skipped.

A DDP run resumed on another number of ranks re-splits the epoch it stopped in
(`resplit_state`): the samples the epoch still owes (the rest of every old shard) become
that epoch's list, cut into the new number of shards the same way (its tail of fewer than
`world_size` samples is left out of the epoch, as a permutation's is). The list travels in
the state (`order`), so a run stopped again within that epoch re-splits it again, on any
size, and every sample of the epoch is still trained once. A parameter-server run re-splits
it keeping the position (`keep_position`): the samples already handed out are dealt to the
front of the new shards, so the index of a batch in the epoch still counts its steps.

A data set read shard by shard from a store (`shards:URL`) gives the sampler its shards'
sizes (`shard_sizes`): each epoch's order is then `data.shard_order`'s, the shards shuffled
and the samples within each, so a rank's contiguous part of it reads a few shards whole.
The sizes travel in the state, so a resume or a re-split rebuilds the same order.

A run that splits its batches by speed (`system.balance`) draws from `PlannedSampler`
(`data.planned`) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from disttrain.data.shard_order import EPOCH_STRIDE, checked_sizes, shard_permutation


def epoch_permutation(num_samples: int, seed: int, epoch: int,
                      shard_sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """The epoch's order of the samples: a permutation from `(seed, epoch)` alone, shard by
    shard when the data set is read by shards (`shard_sizes`, summing to `num_samples`)."""
    if shard_sizes is not None:
        return shard_permutation(shard_sizes, seed, epoch)
    gen = torch.Generator().manual_seed(seed * EPOCH_STRIDE + epoch)
    return torch.randperm(num_samples, generator=gen)


class ShardedSampler:
    """Batches of sample indices for one rank (or worker) of `world_size`.

    Call `set_epoch(e)` at the start of each epoch, then iterate `batches(batch_size)`.
    The position advances when a batch is handed out, so a checkpoint written after that
    batch's step records it as consumed.
    """

    def __init__(self, num_samples: int, *, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, shard_sizes: tuple[int, ...] | None = None):
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
        # The current epoch's samples when a resize re-split it (`resplit_state`); None
        # while the epoch is its whole permutation.
        self.order: torch.Tensor | None = None
        self.shard_sizes: tuple[int, ...] | None = None
        if shard_sizes is not None:
            self.read_by_shards(shard_sizes)

    def read_by_shards(self, shard_sizes: tuple[int, ...] | list[int]) -> None:
        """Order each epoch shard by shard (`data.shard_order`); call before any batch.

        Raises:
            ValueError: the sizes do not sum to the data set's length.
        """
        self.shard_sizes = checked_sizes(shard_sizes, self.num_samples)

    def __len__(self) -> int:
        """Samples in this rank's shard of the current epoch."""
        total = self.num_samples if self.order is None else len(self.order)
        return total // self.world_size

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
            self.order = None

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        """All indices of this rank's shard for `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.order is not None and epoch == self.epoch:
            order = self.order
        elif self.shuffle:
            order = epoch_permutation(self.num_samples, self.seed, epoch, self.shard_sizes)
        else:
            order = torch.arange(self.num_samples)
        length = len(order) // self.world_size
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

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"num_samples": self.num_samples, "world_size": self.world_size,
                                 "rank": self.rank, "seed": self.seed, "epoch": self.epoch,
                                 "position": self.position}
        if self.order is not None:  # only a re-split epoch carries its list
            state["order"] = self.order.clone()
        if self.shard_sizes is not None:  # only a data set read by shards has them
            state["shard_sizes"] = list(self.shard_sizes)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
        check_shard_sizes(state, self.shard_sizes)
        order = state.get("order")
        if order is not None:
            order = _checked_order(order, self.num_samples)
        length = (self.num_samples if order is None else len(order)) // self.world_size
        position = int(state["position"])
        if not 0 <= position <= length:
            raise ValueError(f"sampler position {position} is outside [0, {length}]")
        self.epoch = int(state["epoch"])
        self.position = position
        self.order = order


def check_shard_sizes(state: dict[str, Any], shard_sizes: tuple[int, ...] | None) -> None:
    """Refuse a state whose order was made over other shards (or none) than this run's.

    Raises:
        ValueError: naming what differs.
    """
    saved = state.get("shard_sizes")
    saved = None if saved is None else tuple(int(n) for n in saved)
    if saved != shard_sizes:
        raise ValueError(f"sampler state orders {_shards(saved)} but this run reads {_shards(shard_sizes)}; "
                         "resume with the same data")


def _shards(sizes: tuple[int, ...] | None) -> str:
    return "no shards" if sizes is None else f"{len(sizes)} shards of sizes {list(sizes[:4])}" + \
        ("..." if len(sizes) > 4 else "")


def _layout(state: dict[str, Any]) -> ShardedSampler:
    """A sampler of the state's layout and position (rank 0's)."""
    sizes = state.get("shard_sizes")
    layout = ShardedSampler(int(state["num_samples"]), world_size=int(state["world_size"]),
                            seed=int(state["seed"]), shard_sizes=None if sizes is None else tuple(sizes))
    layout.load_state_dict(state)
    return layout


def _checked_order(order: Any, num_samples: int) -> torch.Tensor:
    """A re-split epoch's list from a checkpoint: distinct indices of the data set."""
    if not isinstance(order, torch.Tensor) or order.dim() != 1 or order.is_floating_point():
        raise ValueError("sampler state's order is not a list of sample indices")
    order = order.to(torch.int64)
    if len(order) and (int(order.min()) < 0 or int(order.max()) >= num_samples):
        raise ValueError(f"sampler state's order names samples outside [0, {num_samples})")
    if len(torch.unique(order)) != len(order):
        raise ValueError("sampler state's order names a sample twice")
    return order


def owed(state: dict[str, Any]) -> torch.Tensor:
    """The samples of the state's epoch not yet handed out by any of its ranks: the rest
    of every rank's shard past the common position, in rank order.

    Raises:
        ValueError: the state is not a valid sampler state.
    """
    layout = _layout(state)
    rest = []
    for rank in range(layout.world_size):
        layout.rank = rank
        rest.append(layout.remaining())
    return torch.cat(rest)


def resplit_state(state: dict[str, Any], world_size: int, rank: int, keep_position: bool = False
                  ) -> dict[str, Any]:
    """The sampler state of rank `rank` of `world_size` that goes on from `state`, written
    by another number of ranks (all at one position, as DDP's are).

    At the start of an epoch the new layout is the epoch's permutation, cut as usual.
    Within an epoch, the epoch's list becomes what it still owes (`owed`), cut into
    `world_size` contiguous shards at position 0; its last `len % world_size` samples are
    left out of the epoch, as a permutation's tail is.

    With `keep_position`, each new shard starts with its share of the samples the old
    ranks already handed out, and the new position is past them: the epoch reads as if
    `world_size` ranks had taken it from its start, so a batch's index in the epoch (the
    parameter server's data blocks) still counts the steps taken. The old ranks' samples
    handed out must then divide evenly over `world_size`.

    Raises:
        ValueError: the state is not a valid sampler state, or it has a balance plan, or
            (`keep_position`) the samples handed out do not divide over `world_size`.
    """
    if "plans" in state or "shares" in state:
        raise ValueError("sampler state has a balance plan, which is made for its number of ranks; "
                         f"resume with --world-size {int(state['world_size'])}")
    base = {"num_samples": int(state["num_samples"]), "world_size": world_size, "rank": rank,
            "seed": int(state["seed"]), "epoch": int(state["epoch"]), "position": 0}
    if state.get("shard_sizes") is not None:
        base["shard_sizes"] = [int(n) for n in state["shard_sizes"]]
    if int(state["position"]) == 0 and "order" not in state:
        return base
    rest = owed(state)
    if not keep_position:
        return {**base, "order": rest}
    written, position = int(state["world_size"]), int(state["position"])
    if position * written % world_size:
        raise ValueError(f"the {written} ranks' {position * written} samples handed out in the epoch do "
                         f"not divide over {world_size} ranks")
    done = _handed_out(state)
    share, length = len(done) // world_size, len(rest) // world_size
    order = torch.cat([torch.cat([done[r * share:(r + 1) * share], rest[r * length:(r + 1) * length]])
                       for r in range(world_size)])
    return {**base, "order": order, "position": share}


def _handed_out(state: dict[str, Any]) -> torch.Tensor:
    """The samples of the state's epoch its ranks handed out (`owed`'s complement), in rank order."""
    layout = _layout(state)
    done = []
    for rank in range(layout.world_size):
        layout.rank = rank
        done.append(layout.consumed())
    return torch.cat(done)
