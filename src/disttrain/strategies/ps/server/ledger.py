"""A shard's data blocks: the run's numbering of them, which blocks and epochs a worker
may push (its own), and the ledger of those whose gradients were applied.

The **ledger** is the set of data blocks whose gradients the shard has applied. A block
already there is never applied again, whoever sends it and however often; blocks
missing from it after a failure are redone. It is saved with the shard's checkpoint, so
parameters, version and ledger never disagree.

**Ownership.** The ledger's fields of a push are checked against the caller's own
assignment before the rules take it.

Block `(epoch * workers + rank) * batches_per_epoch + index` is worker `rank`'s batch
`index` of `epoch` (`worker.blocks`). Without these checks a worker could name another
rank's blocks (its victim's pushes then come back DUPLICATE and their data is never
trained), redo a block of no number on arrival, finish a synchronous step alone with a
negative epoch, or park itself for every later epoch with a huge one.

- `epoch` is in [0, num_epochs) (when the run's epochs are known), whatever else the
  push says: `last_in_epoch` of an epoch the run never reaches is refused.
- `block` is -1 (no block: recorded nowhere) or a block of the run's plan: of an epoch of
  the run, and with local updates the block of a round's last batch (`round_length`: the
  ledgers hold one block per round). A push names a block of the caller's own rank and
  of the push's epoch, and says `last_in_epoch` only with its epoch's last block.
- A `redo` names a block of the plan (never -1) of the push's epoch, of the caller's own
  rank or of a rank the coordinator reassigned (`worker.takeover`); a redo of a live
  worker's block is answered as a membership not heard of yet (retry), since this shard
  may learn of a reassignment after the survivor that takes the block over. (A redo of
  a block the ledger holds is a duplicate: the rules answer it DUPLICATE, applied never.)

The layout of a real shard is the run's (`BlockLayout.of_run`, which `run.layout` builds
from the run's config for every `ps-server`); a layout without `batches_per_epoch`
(rules or shards built bare, in tests of other parts and simulations) checks only the
bounds that hold whatever it is (a block of rank r of epoch e is at least e * workers + r).

Pure: the rules call `BlockLayout.check` with the caller's rank and the ranks reassigned,
and add what they apply to the `Ledger`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disttrain.strategies.ps.server.decisions import Push
from disttrain.strategies.ps.server.members import UnknownGeneration


class InvalidBlock(ValueError):
    """A push whose block or epoch is not the caller's to push (INVALID_ARGUMENT)."""


class NotReassigned(UnknownGeneration):
    """A redo of another rank's block that this shard has not seen reassigned (retry)."""


@dataclass
class Ledger:
    """Applied data blocks, and what was applied or turned away as already done."""

    blocks: set[int] = field(default_factory=set)
    samples_duplicate: int = 0
    _journal: list[int] | None = field(default=None, repr=False)  # blocks added since `mark`

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def add(self, block: int) -> None:
        if block not in self.blocks:
            self.blocks.add(block)
            if self._journal is not None:
                self._journal.append(block)

    def mark(self) -> int:
        """Start journaling what is added, so `rollback` can undo it: a copy of the blocks
        would cost a pass over every applied block on every push."""
        self._journal = []
        return self.samples_duplicate

    def rollback(self, samples_duplicate: int) -> None:
        """Forget the blocks added since `mark` (which returned `samples_duplicate`)."""
        for block in self._journal or ():
            self.blocks.discard(block)
        self._journal = None
        self.samples_duplicate = samples_duplicate

    def copy(self) -> Ledger:
        """The applied blocks as they are now (a copy of the set alone)."""
        return Ledger(set(self.blocks), self.samples_duplicate)

    def between(self, first: int, end: int) -> list[int]:
        """Applied blocks with ids in [first, end) (end 0: no bound), ascending."""
        return sorted(b for b in self.blocks if b >= first and (end <= 0 or b < end))

    def state_dict(self) -> dict[str, Any]:
        return {"blocks": sorted(self.blocks), "samples_duplicate": self.samples_duplicate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.blocks = {int(b) for b in state["blocks"]}
        self.samples_duplicate = int(state["samples_duplicate"])


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int, balanced: bool) -> int:
    """Each worker's batches in an epoch, as its sampler counts them (`data.sampler`,
    `data.planned`): equal shards of `num_samples // world_size` samples cut into batches
    of `batch_size`, the last one possibly shorter; under a balance plan, one batch per
    global batch of `batch_size * world_size` samples (the tail left out), however a plan
    splits it. 0 when the samples do not make one batch per worker."""
    if balanced:
        return num_samples // (batch_size * world_size)
    return -(-(num_samples // world_size) // batch_size)


@dataclass(frozen=True)
class BlockLayout:
    """The run's numbering of data blocks, as far as this shard knows it.

    Args:
        world_size: workers in the run.
        num_epochs: epochs of the run (None: not bounded here).
        batches_per_epoch: each worker's batches in an epoch (None: unknown to the shard).
        round_length: with local updates, the batches of a round (`training.sync_every`):
            a push names the block of its round's last batch; 1 without.
    """

    world_size: int
    num_epochs: int | None = None
    batches_per_epoch: int | None = None
    round_length: int = 1

    @classmethod
    def of_run(cls, world_size: int, num_epochs: int, num_samples: int, batch_size: int, balanced: bool,
               round_length: int = 1) -> BlockLayout:
        """The layout of a run of `num_samples` training samples (after
        `training.max_train_samples`) in batches of `batch_size` per worker, with a balance
        plan or not, and rounds of `round_length` batches (local updates; 1 without)."""
        return cls(world_size, num_epochs, batches_per_epoch(num_samples, batch_size, world_size, balanced),
                   round_length)

    def describe(self) -> str:
        bpe = "?" if self.batches_per_epoch is None else self.batches_per_epoch
        rounds = f", rounds of {self.round_length}" if self.round_length > 1 else ""
        return f"{self.world_size} worker(s) x {bpe} batch(es) per epoch x {self.num_epochs} epoch(s){rounds}"

    def owner(self, block: int) -> tuple[int, int] | None:
        """(epoch, rank) of `block`, or None when the batches per epoch are unknown."""
        place = self.place(block)
        return None if place is None else place[:2]

    def place(self, block: int) -> tuple[int, int, int] | None:
        """(epoch, rank, index) of `block`, or None when the batches per epoch are unknown."""
        if self.batches_per_epoch is None:
            return None
        epoch_rank, index = divmod(block, self.batches_per_epoch)
        epoch, rank = divmod(epoch_rank, self.world_size)
        return epoch, rank, index

    def round_end(self, index: int) -> int:
        """The index of the last batch of the round that holds batch `index` of an epoch
        (each batch without local updates; rounds start at each epoch's first batch, and
        the epoch's last batch ends one)."""
        return min(self.batches_per_epoch - 1, (index // self.round_length + 1) * self.round_length - 1)

    def blocks(self) -> list[int]:
        """Every block the ledgers of the run may hold, in order (needs the batches per
        epoch and the epochs)."""
        bpe = self.batches_per_epoch
        return [block for block in range(self.num_epochs * self.world_size * bpe)
                if self.round_end(block % bpe) == block % bpe]

    def check(self, rank: int, push: Push, reassigned: set[int] | frozenset[int] = frozenset()) -> None:
        """Raises InvalidBlock when `rank` may not push `push`'s block or epoch, and
        NotReassigned for a redo of a live rank's block.
        """
        if push.epoch < 0 or (self.num_epochs is not None and push.epoch >= self.num_epochs):
            bound = "" if self.num_epochs is None else f" of the run's {self.num_epochs}"
            raise InvalidBlock(f"epoch {push.epoch} is not an epoch{bound} (from 0); nothing changed")
        if push.block < -1 or (push.redo and push.block < 0):
            raise InvalidBlock(f"block {push.block} is not a block id"
                               f"{' (a redo names its block)' if push.redo else ''}; nothing changed")
        if push.block < 0:
            return
        place = self.place(push.block)
        if place is None:  # the lower bound, whatever the batches per epoch
            if not push.redo and push.block < push.epoch * self.world_size + rank:
                raise InvalidBlock(f"block {push.block} is not rank {rank}'s in epoch {push.epoch}")
            return
        epoch, owner_rank, index = place
        plan = f"(this shard's plan: {self.describe()}; a worker of another config or training set numbers " \
               "its blocks otherwise); nothing changed"
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise InvalidBlock(f"block {push.block} is of epoch {epoch}, past the run's {self.num_epochs}: "
                               f"no block of the run {plan}")
        if self.round_end(index) != index:
            raise InvalidBlock(f"block {push.block} is batch {index} of its epoch, which ends no round of "
                               f"{self.round_length}: a push names its round's last batch {plan}")
        if epoch != push.epoch:
            raise InvalidBlock(f"block {push.block} is of epoch {epoch}, not of the push's epoch "
                               f"{push.epoch} {plan}")
        if not push.redo:
            if owner_rank != rank:
                raise InvalidBlock(f"block {push.block} is rank {owner_rank}'s of epoch {epoch}, not rank "
                                   f"{rank}'s: a worker pushes its own blocks {plan}")
            if push.last_in_epoch and index != self.batches_per_epoch - 1:
                raise InvalidBlock(f"block {push.block} is batch {index} of epoch {epoch}, not its last: "
                                   f"the push cannot end the epoch {plan}")
        elif owner_rank != rank and owner_rank not in reassigned:
            raise NotReassigned(f"block {push.block} belongs to rank {owner_rank}, which this shard has "
                                "not seen reassigned; retry once the membership arrives")
