"""The aggregation rules of one parameter-server shard: sync, SSP(tau) and async.

Pure decisions, apart from any transport or tensor math: the servicer calls `offer()`
under its lock with an opaque payload, and applies what the decision says. Time is
passed in (`now`), so tests step a fake clock by hand.

- `sync`: gradients computed on the current version are held until every worker still
  training has pushed (or, with `backup_workers` b, the first of them minus b); then they
  are applied together and the version goes up by one. A gradient for an older version
  arrives late and is dropped (counted).
- `ssp`: a gradient computed on version v is applied on arrival when
  `version - v <= staleness_bound`; otherwise it is rejected, and the worker refetches.
- `async`: every gradient is applied on arrival.

A push is named by (worker, step); one already taken is acknowledged as a duplicate and
changes nothing, so clients can retry pushes safely.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

MODES = ("sync", "async", "ssp")


class Outcome(Enum):
    APPLIED = 0     # applied now (async, ssp), or completed a synchronous step
    BUFFERED = 1    # held for the rest of a synchronous step
    STALE = 2       # ssp: too stale; refetch and recompute
    LATE = 3        # sync: its step was applied without it; dropped
    DUPLICATE = 4   # this (worker, step) was taken before; nothing changed


class PushRefused(ValueError):
    """A push that breaks the protocol (unknown worker, a version from the future, a
    second gradient for one synchronous step). Nothing changes."""


@dataclass
class Contribution:
    rank: int
    weight: float
    payload: Any


@dataclass
class Decision:
    """What to do with a push. `apply` lists the gradients to combine now (by weight,
    in rank order), or is empty; the version has already been advanced when it is not."""

    outcome: Outcome
    version: int
    staleness: int
    apply: list[Contribution] = field(default_factory=list)


class AggregationRules:
    """Versions, membership and the aggregation decisions of one shard.

    Args:
        mode: "sync", "async" or "ssp".
        world_size: workers in the run.
        staleness_bound: the ssp bound tau.
        backup_workers: sync only: a step is applied after `world_size - done - b` gradients.
    """

    def __init__(self, mode: str, world_size: int, staleness_bound: int = 0, backup_workers: int = 0):
        if mode not in MODES:
            raise ValueError(f"aggregation mode {mode!r} is not one of {', '.join(MODES)}")
        if world_size < 1 or staleness_bound < 0 or not 0 <= backup_workers < world_size:
            raise ValueError(f"invalid rules: world_size={world_size}, staleness={staleness_bound}, "
                             f"backup_workers={backup_workers}")
        self.mode = mode
        self.world_size = world_size
        self.staleness_bound = staleness_bound
        self.backup_workers = backup_workers
        self.version = 0
        self.ranks: dict[str, int] = {}
        self.done: set[int] = set()
        self.last_step: dict[int, int] = {}
        self.pending: dict[int, Contribution] = {}
        self.round_started: float | None = None
        self.round_wait_s = 0.0
        self.staleness_histogram: Counter[int] = Counter()
        self.counts: Counter[str] = Counter()

    # -- membership ---------------------------------------------------------------------

    def register(self, worker_id: str, requested_rank: int = -1) -> int:
        """The rank of `worker_id`: its earlier one, `requested_rank`, or the lowest free.

        Raises:
            PushRefused: the run is full, or the requested rank belongs to another worker.
        """
        if worker_id in self.ranks:
            rank = self.ranks[worker_id]
            if requested_rank not in (-1, rank):
                raise PushRefused(f"worker {worker_id!r} already holds rank {rank}, not {requested_rank}")
            return rank
        taken = set(self.ranks.values())
        if requested_rank == -1:
            free = [r for r in range(self.world_size) if r not in taken]
            if not free:
                raise PushRefused(f"all {self.world_size} worker ranks are taken; start at most "
                                  f"system.num_workers={self.world_size} workers")
            requested_rank = free[0]
        elif not 0 <= requested_rank < self.world_size:
            raise PushRefused(f"rank {requested_rank} is outside [0, {self.world_size})")
        elif requested_rank in taken:
            raise PushRefused(f"rank {requested_rank} is held by another worker")
        self.ranks[worker_id] = requested_rank
        return requested_rank

    def rank_of(self, worker_id: str) -> int:
        """Raises PushRefused for a worker that never registered."""
        if worker_id not in self.ranks:
            raise PushRefused(f"unknown worker {worker_id!r}: call RegisterWorker first")
        return self.ranks[worker_id]

    def mark_done(self, worker_id: str, now: float) -> Decision:
        """`worker_id` has finished: it leaves the synchronous quorum, which may complete
        the pending step (then `apply` is not empty)."""
        self.done.add(self.rank_of(worker_id))
        return self._maybe_complete_round(now, Decision(Outcome.BUFFERED, self.version, 0))

    def all_done(self) -> bool:
        return len(self.done) >= self.world_size

    def quorum(self) -> int:
        """Gradients a synchronous step needs."""
        return max(1, self.world_size - len(self.done) - self.backup_workers)

    # -- pushes -------------------------------------------------------------------------

    def offer(self, worker_id: str, step: int, base_version: int, weight: float, payload: Any,
              now: float) -> Decision:
        """Decide what to do with one well-formed push.

        Raises:
            PushRefused: unknown worker, base version ahead of the shard, or a second
                gradient of one worker for the same synchronous step.
        """
        rank = self.rank_of(worker_id)
        if step <= self.last_step.get(rank, 0):
            self.counts["duplicates"] += 1
            return Decision(Outcome.DUPLICATE, self.version, self.version - base_version)
        if base_version > self.version:
            raise PushRefused(f"base version {base_version} is ahead of this shard's version "
                              f"{self.version}; pull parameters before pushing")
        staleness = self.version - base_version
        if self.mode == "ssp" and staleness > self.staleness_bound:
            self.counts["rejected_stale"] += 1
            return Decision(Outcome.STALE, self.version, staleness)
        if self.mode == "sync":
            return self._offer_sync(rank, step, staleness, weight, payload, now)
        self.last_step[rank] = step
        self.staleness_histogram[staleness] += 1
        self.counts["applied"] += 1
        self.counts["samples"] += int(weight)
        self.version += 1
        return Decision(Outcome.APPLIED, self.version, staleness, [Contribution(rank, 1.0, payload)])

    def _offer_sync(self, rank: int, step: int, staleness: int, weight: float, payload: Any,
                    now: float) -> Decision:
        if staleness > 0:
            self.last_step[rank] = step
            self.counts["dropped_late"] += 1
            return Decision(Outcome.LATE, self.version, staleness)
        if rank in self.pending:
            raise PushRefused(f"worker rank {rank} already pushed a gradient for version "
                              f"{self.version}; wait for the next version")
        self.last_step[rank] = step
        self.staleness_histogram[0] += 1
        if not self.pending:
            self.round_started = now
        self.pending[rank] = Contribution(rank, weight, payload)
        return self._maybe_complete_round(now, Decision(Outcome.BUFFERED, self.version, 0))

    def _maybe_complete_round(self, now: float, decision: Decision) -> Decision:
        if self.mode != "sync" or not self.pending or len(self.pending) < self.quorum():
            return decision
        contributions = [self.pending[rank] for rank in sorted(self.pending)]
        total = sum(c.weight for c in contributions)
        self.counts["samples"] += int(total)
        for c in contributions:
            c.weight /= total
        self.pending.clear()
        self.round_wait_s += now - (self.round_started if self.round_started is not None else now)
        self.round_started = None
        self.counts["applied"] += len(contributions)
        self.counts["steps"] += 1
        self.version += 1
        return Decision(Outcome.APPLIED, self.version, decision.staleness, contributions)

    # -- persistence ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything but pending gradients (a restarted shard waits for them again)."""
        return {"mode": self.mode, "version": self.version, "ranks": dict(self.ranks),
                "done": sorted(self.done), "last_step": dict(self.last_step),
                "round_wait_s": self.round_wait_s,
                "staleness_histogram": dict(self.staleness_histogram), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ValueError when the state was written in another mode."""
        if state["mode"] != self.mode:
            raise ValueError(f"the checkpoint was written in {state['mode']} mode, not {self.mode}")
        self.version = int(state["version"])
        self.ranks = {str(k): int(v) for k, v in state["ranks"].items()}
        self.done = {int(r) for r in state["done"]}
        self.last_step = {int(k): int(v) for k, v in state["last_step"].items()}
        self.round_wait_s = float(state["round_wait_s"])
        self.staleness_histogram = Counter({int(k): int(v) for k, v in state["staleness_histogram"].items()})
        self.counts = Counter({str(k): int(v) for k, v in state["counts"].items()})
        self.pending.clear()
        self.round_started = None
