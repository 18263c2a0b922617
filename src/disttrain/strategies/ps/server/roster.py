"""Who a shard counts on: the data ledger and the live membership, as pure bookkeeping.

- The **ledger** is the set of data blocks whose gradients the shard has applied. A block
  already there is never applied again, whoever sends it and however often; blocks
  missing from it after a failure are redone. It is saved with the shard's checkpoint,
  so parameters, version and ledger never disagree.
- The **roster** is the shard's view of the run's membership. Without a coordinator every
  registered worker counts. With one, the coordinator's membership decides: a live worker
  counts, registered here or not yet (a shard restarted before its first checkpoint
  learns each one's rank only as it registers again), a worker it declared failed leaves
  the synchronous quorum at once, and a push stamped with a
  generation its worker has since been declared failed in is refused (a worker that hung
  and woke up cannot apply its late gradients). A worker that sent its last block of an
  epoch is *parked* for that epoch: synchronous steps of that epoch stop waiting for it,
  so a worker that fell behind (it was restarted) finishes its epoch alone. A worker the
  coordinator *reassigned* (failed for longer than `coordinator.reassign_after`) is given
  up on: the other workers take over its blocks (`worker.takeover`), the barriers stop
  waiting for it, and it counts as done; if it rejoins it is a live worker again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FencedPush(ValueError):
    """A push from a worker the run declared failed, or of a generation it left."""


class UnknownGeneration(ValueError):
    """A push stamped with a generation this shard has not heard of yet (retry soon)."""


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


@dataclass
class Roster:
    """The live workers (by rank) as the coordinator last told this shard.

    `generation` 0 means no coordinator: every registered rank is live.
    """

    generation: int = 0
    members: dict[str, int] | None = None  # live worker ids -> the generation each joined in
    live: set[int] | None = None
    away: frozenset[str] = frozenset()  # ids of the workers reassigned
    reassigned: set[int] = field(default_factory=set)  # their ranks here
    joined: dict[int, int] = field(default_factory=dict)
    # live worker ids not registered here (yet): a shard restarted before its first
    # checkpoint knows no worker's rank until each registers again
    unregistered: frozenset[str] = frozenset()
    parked: dict[int, int] = field(default_factory=dict)
    num_fenced: int = 0

    def update(self, generation: int, members: dict[str, int], away: frozenset[str] = frozenset()) -> bool:
        """Take a newer membership (`away`: the workers reassigned); False (nothing
        changes) when it is not newer. Call `resolve` after."""
        if generation <= self.generation:
            return False
        self.generation, self.members, self.away = generation, dict(members), frozenset(away)
        return True

    def resolve(self, ranks: dict[str, int]) -> None:
        """Map the members to the ranks registered here (`ranks`: worker id -> rank)."""
        if self.members is not None:
            self.joined = {ranks[w]: g for w, g in self.members.items() if w in ranks}
            self.live = set(self.joined)
            self.unregistered = frozenset(w for w in self.members if w not in ranks)
            self.reassigned = {ranks[w] for w in self.away if w in ranks} - self.live

    def is_live(self, rank: int) -> bool:
        return self.live is None or rank in self.live

    def check(self, rank: int, generation: int) -> None:
        """Raises FencedPush or UnknownGeneration when `rank`'s push of `generation` may
        not be applied."""
        if self.live is None:
            return
        if generation > self.generation:
            raise UnknownGeneration(f"generation {generation} is newer than this shard's "
                                    f"{self.generation}; the membership is on its way, retry")
        if rank not in self.live or self.joined.get(rank) != generation:
            self.num_fenced += 1
            raise FencedPush(f"worker rank {rank} was declared failed (its push is of generation "
                             f"{generation}, the run is at {self.generation}); its gradient is not "
                             "applied. Restart the worker: it rejoins in a new generation")

    def park(self, rank: int, epoch: int) -> None:
        """`rank` sent its last block of `epoch`."""
        self.parked[rank] = max(epoch, self.parked.get(rank, -1))

    def waits_for(self, rank: int, epoch: int) -> bool:
        """Whether a synchronous step of `epoch` waits for `rank`."""
        return self.is_live(rank) and self.parked.get(rank, -1) < epoch

    def state_dict(self) -> dict[str, Any]:
        """The parked epochs (membership comes again from the coordinator after a restart)."""
        return {"parked": dict(self.parked), "num_fenced": self.num_fenced}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parked = {int(k): int(v) for k, v in state["parked"].items()}
        self.num_fenced = int(state["num_fenced"])
