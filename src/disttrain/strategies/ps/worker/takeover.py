"""Taking over the blocks of a worker the run gave up on (reassignment): who does which
block, and when its owner takes them back.

The coordinator *reassigns* a worker declared failed that has not rejoined within
`coordinator.reassign_after` seconds. The shards' barriers then stop waiting for it and
answer its row as NaN (`server.barriers`), so at each epoch's end every other worker
learns from the same answer (the "trained" barrier) who is away, and each takes its
`share` of their blocks of that epoch and of the epochs before it that some shard lacks:
the away workers' batches in order, dealt round-robin over the workers present, so the
shares differ by at most one block and everyone computes the same split.

A taken-over block is pushed as a `redo` (named by its block, not its step), in every
aggregation mode:

- The shards apply a redo on arrival, and the survivor's own step numbers, which name
  and order its pushes, are left alone (a push numbered as one more step of its own would
  shift every later step, and a step number already used is answered DUPLICATE).
- Sync: the blocks are taken over after every survivor's last step of the epoch (each is
  parked for it), between the "trained" barrier and a "taken-over" one, so no
  synchronous step waits for them or is made late by them, and the steps of an epoch are
  the same whoever is alive. Each block is one update on the parameters of the moment,
  as a block a restarted shard lost is redone. Extra synchronous steps instead would
  need every survivor to take the same number of blocks (shares differ by one) and would
  average a taken-over block with the survivors' own.
- Async and SSP: a redo is an extra block of the survivor's own, applied on arrival; its
  gradient is computed on parameters pulled just before, so within any staleness bound.

Taking back: before each block a survivor asks whether its owner is back (`Away`, fed by
the coordinator's membership); if so, the block is left to it. A worker that rejoins
resumes from its checkpoint and pushes its own blocks; every shard that already applied
one (a survivor's) answers it DUPLICATE, and every survivor's redo of a block the owner
applied is answered DUPLICATE too, so each block is applied once on each shard.
"""

from __future__ import annotations

import math


def away_ranks(rows: list[list[float]]) -> list[int]:
    """The ranks a barrier's answer holds as away (their rows NaN: reassigned)."""
    return [rank for rank, row in enumerate(rows) if row and all(math.isnan(v) for v in row)]


def share(rank: int, away: list[int], world_size: int, batches_per_epoch: int) -> list[tuple[int, int]]:
    """The (owner rank, batch index) pairs of each epoch that worker `rank` takes over
    from the `away` ranks: their batches, owner by owner, dealt round-robin over the
    ranks present in rank order. Empty for a rank that is itself away.

    Raises:
        ValueError: every rank is away, or a rank is outside the run.
    """
    if any(not 0 <= r < world_size for r in away) or not 0 <= rank < world_size:
        raise ValueError(f"ranks {sorted(away)} and {rank} must be in [0, {world_size})")
    present = [r for r in range(world_size) if r not in away]
    if not present:
        raise ValueError("every worker is away: nobody is left to take the blocks over")
    if rank not in present:
        return []
    batches = [(owner, index) for owner in sorted(set(away)) for index in range(batches_per_epoch)]
    return batches[present.index(rank)::len(present)]


def present_slice(rank: int, away: list[int], world_size: int) -> tuple[int, int] | None:
    """(position, count) of `rank` among the ranks present, to split work that the away
    ranks would have had a part of (the evaluation); None for a rank away."""
    present = [r for r in range(world_size) if r not in away]
    return (present.index(rank), len(present)) if rank in present else None


class Away:
    """Which reassigned workers are back, as the coordinator's membership last told this
    worker (its watcher calls `update`; the training thread reads `is_back`).

    A worker is back once it was seen reassigned and then alive: a membership older than
    its reassignment (a watcher behind the shards) shows it alive too, and must not keep
    its blocks from being taken over.
    """

    def __init__(self) -> None:
        self._seen_away: dict[str, int] = {}  # worker id -> rank, ever seen reassigned
        self._back: frozenset[int] = frozenset()

    def update(self, generation: int, live: dict[str, int], away: dict[str, int]) -> None:
        """A membership: live worker ids (-> their generation), reassigned ids -> rank."""
        seen = {**self._seen_away, **away}
        self._seen_away = seen
        self._back = frozenset(rank for worker, rank in seen.items() if worker in live)

    def is_back(self, rank: int) -> bool:
        return rank in self._back
