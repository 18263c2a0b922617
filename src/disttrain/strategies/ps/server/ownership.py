"""Which data blocks and epochs a worker may push: the ledger's fields checked against
the caller's own assignment before the rules take a push.

Block `(epoch * workers + rank) * batches_per_epoch + index` is worker `rank`'s batch
`index` of `epoch` (`worker.blocks`). Without these checks a worker could name another
rank's blocks (its victim's pushes then come back DUPLICATE and their data is never
trained), redo a block of no number on arrival, finish a synchronous step alone with a
negative epoch, or park itself for every later epoch with a huge one.

- `epoch` is in [0, num_epochs) (when the run's epochs are known), whatever else the
  push says: `last_in_epoch` of an epoch the run never reaches is refused.
- `block` is -1 (no block: recorded nowhere) or a block of the caller's own rank and of
  the push's epoch; when the shard does not know `batches_per_epoch`, only the bounds
  that hold whatever it is (a block of rank r of epoch e is at least e * workers + r).
- A `redo` names a real block (never -1) of the caller's own rank, or of a rank the
  coordinator reassigned (`worker.takeover`); a redo of a live worker's block is answered
  as a membership not heard of yet (retry), since this shard may learn of a reassignment
  after the survivor that takes the block over.

Pure: the rules call `check` with the caller's rank and the ranks reassigned.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.strategies.ps.server.decisions import Push
from disttrain.strategies.ps.server.roster import UnknownGeneration


class InvalidBlock(ValueError):
    """A push whose block or epoch is not the caller's to push (INVALID_ARGUMENT)."""


class NotReassigned(UnknownGeneration):
    """A redo of another rank's block that this shard has not seen reassigned (retry)."""


@dataclass(frozen=True)
class BlockLayout:
    """The run's numbering of data blocks, as far as this shard knows it.

    Args:
        world_size: workers in the run.
        num_epochs: epochs of the run (None: not bounded here).
        batches_per_epoch: each worker's batches in an epoch (None: unknown to the shard).
    """

    world_size: int
    num_epochs: int | None = None
    batches_per_epoch: int | None = None

    def owner(self, block: int) -> tuple[int, int] | None:
        """(epoch, rank) of `block`, or None when the batches per epoch are unknown."""
        if self.batches_per_epoch is None:
            return None
        epoch, rank = divmod(block // self.batches_per_epoch, self.world_size)
        return epoch, rank

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
        owner = self.owner(push.block)
        if owner is None:  # the lower bound, whatever the batches per epoch
            if not push.redo and push.block < push.epoch * self.world_size + rank:
                raise InvalidBlock(f"block {push.block} is not rank {rank}'s in epoch {push.epoch}")
            return
        epoch, owner_rank = owner
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise InvalidBlock(f"block {push.block} is of epoch {epoch}, past the run's {self.num_epochs}")
        if not push.redo:
            if (epoch, owner_rank) != (push.epoch, rank):
                raise InvalidBlock(f"block {push.block} is rank {owner_rank}'s of epoch {epoch}, not rank "
                                   f"{rank}'s of epoch {push.epoch}: a worker pushes its own blocks")
        elif owner_rank != rank and owner_rank not in reassigned:
            raise NotReassigned(f"block {push.block} belongs to rank {owner_rank}, which this shard has "
                                "not seen reassigned; retry once the membership arrives")
