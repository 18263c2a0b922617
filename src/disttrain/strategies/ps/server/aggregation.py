"""The aggregation rules of one parameter-server shard: sync, SSP(tau) and async.

Pure decisions, apart from any transport or tensor math: the servicer calls `offer()`
under its lock with an opaque payload, and applies what the decision says. Time is
passed in (`now`), so tests step a fake clock by hand.

- `sync`: gradients computed on the current version are held until every live worker
  still training that epoch has pushed (or, with `backup_workers` b, all but b of them);
  then they are applied together and the version goes up by one. A gradient for an
  older version arrives late and is dropped (counted; the worker computes it again, but
  with backup workers, whose slowest gradients are dropped by design).
- `ssp` (`ssp_clock` "steps", the default): SSP as Ho et al. define it. Every gradient
  is applied on arrival, and none is refused for staleness; the bound tau
  (`staleness_bound`) is on steps: a worker whose push of step s is more than tau steps
  ahead of the slowest worker that still counts waits before it computes again
  (`may_go_on`; the shard holds its reply), see `clocks`. tau = 0 is lockstep, as sync;
  a tau beyond the run's steps is async.
- `ssp` with `ssp_clock` "versions": a gradient computed on version v is applied on
  arrival when `version - v <= staleness_bound`; otherwise it is rejected, and the
  worker refetches and computes it again.
- `async`: every gradient is applied on arrival.

A push is named by (worker, step), and carries the data block it was computed from.
Steps go one at a time (see `StepOrder`): a step from far ahead is refused. A push
already taken, or whose block is in the ledger or pending, is acknowledged as a
duplicate and changes nothing, so clients retry safely and a restarted worker that
recomputes blocks already applied changes nothing (in sync mode its duplicate still
counts towards the step, as a contribution of no samples, so the step does not wait for
it). A push marked `redo` (a block found missing after a failure) is applied on arrival
in every mode. A push whose base version is ahead of the shard (the shard restarted from
an older checkpoint) is answered ROLLED_BACK: the worker pulls again and recomputes.

Sync mode counts the run's steps (`sync_step`): one per synchronous step completed,
none for a block redone or applied on arrival, so every shard gives a step the same
number and workers compare their shards' answers by it (see `worker.agreement`). A push
belongs to the pending step when it was computed on parameters of the shard's current
step, whatever blocks were redone on them since (`step_version`: the version the step
began at): a redo moves the version on within a step, and a push computed before it is
no later for that (dropped as late, its worker would wait for a step that waits for
it). A shard restored from an older checkpoint has lost steps the others kept: it is
`restored` (every answer says so) until it completes a synchronous step, and counts
that step on from the highest step its pushes were computed on, so the numbers agree
again from its first step after the restart (the steps it lost are redone as blocks).
A stand-in (`Push.stand_in`) from a worker that restarted in the middle of a step
counts for it, with no samples, in a pending step that waits for it, and changes
nothing anywhere else.

The rules save themselves with their shard's checkpoint (`state_dict`: everything but
pending gradients, which a restarted shard's workers push again), and undo the decisions
of an update the shard refused because it would have left a parameter non-finite
(`mark` and `rollback` around a push; `void` for a step completed without one).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from disttrain.strategies.ps.server.clocks import StepClocks
from disttrain.strategies.ps.server.decisions import (
    Contribution,
    Decision,
    Outcome,
    Push,
    PushRefused,
)
from disttrain.strategies.ps.server.ledger import BlockLayout, Ledger
from disttrain.strategies.ps.server.members import Roster, StepOrder

__all__ = ["MODES", "SSP_CLOCKS", "AggregationRules", "Contribution", "Decision", "Outcome", "Push",
           "PushRefused"]

MODES = ("sync", "async", "ssp")
# What SSP's bound counts: the steps a worker runs ahead of the slowest (Ho et al.), or
# the versions a gradient's parameters are behind (refused beyond it, and recomputed).
SSP_CLOCKS = ("steps", "versions")


class AggregationRules:
    """Versions, membership, the data ledger and the aggregation decisions of one shard.

    Args:
        mode: "sync", "async" or "ssp".
        world_size: workers in the run.
        staleness_bound: the ssp bound tau.
        ssp_clock: what tau counts in ssp mode: "steps" (a worker waits once tau steps
            ahead of the slowest) or "versions" (a gradient more than tau versions
            behind is refused).
        backup_workers: sync only: a step is applied after all but b of its workers pushed.
        layout: the run's block numbering, which blocks and epochs each worker may push
            (`ledger`; default: only what holds in any run).
    """

    def __init__(self, mode: str, world_size: int, staleness_bound: int = 0, backup_workers: int = 0,
                 layout: BlockLayout | None = None, ssp_clock: str = "steps"):
        if mode not in MODES:
            raise ValueError(f"aggregation mode {mode!r} is not one of {', '.join(MODES)}")
        if ssp_clock not in SSP_CLOCKS:
            raise ValueError(f"ssp clock {ssp_clock!r} is not one of {', '.join(SSP_CLOCKS)}")
        if world_size < 1 or staleness_bound < 0 or not 0 <= backup_workers < world_size:
            raise ValueError(f"invalid rules: world_size={world_size}, staleness={staleness_bound}, "
                             f"backup_workers={backup_workers}")
        self.mode = mode
        self.world_size = world_size
        self.staleness_bound = staleness_bound
        self.ssp_clock = ssp_clock
        # ssp by steps: pushes wait on clocks (`may_go_on`), none is refused as stale
        self.bounds_steps = mode == "ssp" and ssp_clock == "steps"
        self.clocks = StepClocks(world_size)
        self.backup_workers = backup_workers
        self.layout = layout or BlockLayout(world_size)
        self.version = 0
        self.sync_step = 0
        self.step_version = 0  # sync: the version the current step began at (redone blocks move on from it)
        # sync: per rank, the step its pushes are computed on now (`Push.sync_step` of its
        # latest push, or what it said registering); kept in memory only, told again
        self.stepping: dict[int, int] = {}
        # sync: came back from a checkpoint (or from nothing) after a restart and completed
        # no synchronous step since: `sync_step` may lag the other shards' by steps it lost
        self.restored = False
        self.ranks: dict[str, int] = {}
        self.done: set[int] = set()
        self.last_step: dict[int, int] = {}
        self.order = StepOrder()
        self.pending: dict[int, Contribution] = {}
        self.ledger = Ledger()
        self.roster = Roster()
        self.round_started: float | None = None
        self.round_wait_s = 0.0
        self._live_counted: tuple[set[int] | None, int, int] = (None, 0, 0)  # `_num_live`'s
        self.max_round_wait_s = 0.0
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
            self.order.forget(rank)
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
        self.roster.resolve(self.ranks)
        self.clocks.changed()
        self.order.forget(requested_rank)
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
        self.clocks.changed()
        return self._maybe_complete_round(now, Decision(Outcome.BUFFERED, self.version, 0))

    def set_membership(self, generation: int, live: dict[str, int], now: float,
                       away: frozenset[str] = frozenset()) -> Decision:
        """The coordinator's membership: live worker ids -> the generation each joined in,
        and the ids of the workers reassigned (`away`). A worker that left may complete the
        pending synchronous step."""
        if self.roster.update(generation, live, away):
            self.roster.resolve(self.ranks)
            self.clocks.changed()
        return self._maybe_complete_round(now, Decision(Outcome.BUFFERED, self.version, 0))

    def joined(self, worker_id: str, epochs_done: int, now: float, sync_step: int = 0) -> Decision:
        """After `register`: `worker_id` says it has trained `epochs_done` epochs to their
        end (at most the run's epochs, when known), and that its pushes are computed on
        step `sync_step` now (0: none yet). Steps of those epochs stop waiting for it, as
        its pushes of their last blocks said (a shard restored from before them lost that),
        and so does a step before `sync_step` on a shard `restored` (see `_this_step`).
        Its registration may complete the pending synchronous step (then `advanced`): a
        step waits for every live worker to have registered here."""
        rank, count = self.rank_of(worker_id), epochs_done
        self.stepping.pop(rank, None)  # a restarted worker says anew (0: it has pushed nothing yet)
        if sync_step > 0:
            self.stepping[rank] = sync_step
        if count > 0:
            last = count - 1 if self.layout.num_epochs is None else min(count, self.layout.num_epochs) - 1
            self.roster.park(rank, last)
        return self._maybe_complete_round(now, Decision(Outcome.BUFFERED, self.version, 0))

    def all_done(self) -> bool:
        return self._num_done() >= self.world_size

    def finisher(self) -> int:
        """The rank that writes the run's final model and stops the shards: the lowest one
        not reassigned (as the workers reckon it at their last barrier)."""
        return min((r for r in range(self.world_size) if r not in self.roster.reassigned), default=0)

    def _num_done(self) -> int:
        """Workers done, or given up on with their blocks reassigned (`Roster`)."""
        return len(self.done | self.roster.reassigned)

    def _waiting_for(self, epoch: int) -> set[int]:
        """Ranks a synchronous step of `epoch` waits for."""
        return {r for r in range(self.world_size) if r not in self.done and self.roster.waits_for(r, epoch)}

    def may_go_on(self, rank: int, step: int, epoch: int) -> bool:
        """ssp by steps: whether `rank`, having pushed `step` of `epoch`, may compute its
        next step: `step` is at most `staleness_bound` steps ahead of the slowest worker
        that counts for `epoch` (see `clocks`; `_waiting_for`'s rule). True in every
        other mode."""
        if not self.bounds_steps:
            return True
        slowest = self.slowest_clock(epoch)
        return slowest is None or step - slowest <= self.staleness_bound

    def slowest_clock(self, epoch: int) -> int | None:
        """The lowest clock of the workers a step of `epoch` counts on (None: none does):
        not done, live, and not parked for `epoch`."""
        parked = [r for r, last in self.roster.parked.items() if last >= epoch]
        return self.clocks.slowest(lambda r: r not in self.done and self.roster.is_live(r), parked)

    def quorum(self, epoch: int = 0) -> int:
        """Gradients a synchronous step of `epoch` needs."""
        return max(1, len(self._waiting_for(epoch)) - self.backup_workers)

    # -- pushes -------------------------------------------------------------------------

    def offer(self, push: Push, payload: Any, now: float) -> Decision:
        """Decide what to do with one well-formed push.

        Raises:
            PushRefused: unknown worker, a step from far ahead, or a second gradient of one
                worker for the same synchronous step.
            FencedPush, UnknownGeneration: see `Roster.check`.
            InvalidBlock, NotReassigned: see `BlockLayout.check`.
        """
        rank = self.rank_of(push.worker_id)
        self.roster.check(rank, push.generation)
        self.layout.check(rank, push, self.roster.reassigned)
        if push.redo:  # named by its block, not its step
            return self._offer(rank, push, payload, now)
        self.order.check(rank, push.step, self.last_step.get(rank, 0))
        if not push.stand_in:
            self.stepping[rank] = push.sync_step
        decision = self._offer(rank, push, payload, now)
        self.order.record(rank, push.step)
        if self.bounds_steps and decision.outcome is not Outcome.ROLLED_BACK:
            self.clocks.tick(rank, push.step)
        return decision

    def _offer(self, rank: int, push: Push, payload: Any, now: float) -> Decision:
        staleness = self.version - push.base_version
        in_step = self.mode == "sync" and self._of_current_step(push)
        if push.stand_in:  # never applied; it stands in for the worker where a step waits for it
            decision = Decision(Outcome.DUPLICATE, self.version, max(staleness, 0))
            if in_step and rank not in self.pending:
                return self._enter_round(rank, push, None, now, decision)
            return decision
        if self._is_duplicate(rank, push):
            self.counts["duplicates"] += 1
            self.ledger.samples_duplicate += int(push.weight)
            decision = Decision(Outcome.DUPLICATE, self.version, max(staleness, 0))
            if in_step and not push.redo and rank not in self.pending:
                return self._enter_round(rank, push, None, now, decision)
            return self._park(rank, push, now, decision)
        if staleness < 0:
            return Decision(Outcome.ROLLED_BACK, self.version, 0)
        if push.redo:
            return self._park(rank, push, now, self._apply_now(rank, push, payload, staleness))
        if self.mode == "ssp" and not self.bounds_steps and staleness > self.staleness_bound:
            self.counts["rejected_stale"] += 1
            return Decision(Outcome.STALE, self.version, staleness)
        if self.mode != "sync":
            return self._park(rank, push, now, self._apply_now(rank, push, payload, staleness))
        if not in_step:
            self.counts["dropped_late"] += 1
            return Decision(Outcome.LATE, self.version, staleness)
        if rank in self.pending:
            raise PushRefused(f"worker rank {rank} already pushed a gradient for version "
                              f"{self.version}; wait for the next version")
        self.staleness_histogram[staleness] += 1  # > 0: blocks were redone since it was computed
        decision = Decision(Outcome.BUFFERED, self.version, staleness)
        return self._enter_round(rank, push, payload, now, decision)

    def _of_current_step(self, push: Push) -> bool:
        """Sync: `push` was computed on parameters of the current step (before or after
        blocks redone in it), so it joins the pending step."""
        return self.step_version <= push.base_version <= self.version

    def _is_duplicate(self, rank: int, push: Push) -> bool:
        if push.step <= self.last_step.get(rank, 0) and not push.redo:
            return True
        return push.block >= 0 and (push.block in self.ledger
                                    or any(c.block == push.block for c in self.pending.values()))

    def _apply_now(self, rank: int, push: Push, payload: Any, staleness: int) -> Decision:
        self.last_step[rank] = max(push.step, self.last_step.get(rank, 0))
        self.staleness_histogram[staleness] += 1
        self.counts["applied"] += 1
        self.counts["samples"] += int(push.weight)
        self._record(push.block)
        self.version += 1
        return Decision(Outcome.APPLIED, self.version, staleness, [Contribution(rank, 1.0, payload)], True)

    def _record(self, block: int) -> None:
        if block >= 0:
            self.ledger.add(block)

    def _enter_round(self, rank: int, push: Push, payload: Any, now: float, decision: Decision) -> Decision:
        self.last_step[rank] = max(push.step, self.last_step.get(rank, 0))
        if not self.pending:
            self.round_started = now
        weight = push.weight if payload is not None else 0.0
        self.pending[rank] = Contribution(rank, weight, payload, push.block if payload is not None else -1,
                                          push.epoch, push.sync_step)
        return self._park(rank, push, now, decision)

    def _park(self, rank: int, push: Push, now: float, decision: Decision) -> Decision:
        if push.last_in_epoch:
            self.roster.park(rank, push.epoch)
        return self._maybe_complete_round(now, decision, rank)

    def next_step(self, now: float) -> Decision:
        """Sync: apply the pending step when what is pending completes it already (pushes
        held over for a later step, see `_this_step`, may do after a step was applied);
        `advanced` says whether it did. Call after applying any decision that advanced."""
        return self._maybe_complete_round(now, Decision(Outcome.BUFFERED, self.version, 0))

    def _this_step(self) -> list[int]:
        """The ranks whose pending pushes the pending step applies: all of them, but on a
        shard `restored`, pushes computed on a later step than another's (`Push.sync_step`)
        are held over for the step after. Their worker holds that later step on the other
        shards already: the step the others' pushes are for went on without it there (it
        was restarted, and its push of that step lost), and the restored shard, which
        lost that with the steps, must not wait for it either (`_accounted`). Put into
        one step, the pushes of two steps would count as one of them: a step apart from
        the other shards for the workers of the other, each then waiting for a step that
        waits for its own next push. (A shard that was not restored saw each step go on:
        every push it holds is of its pending step. Backup workers are off the agreement.)"""
        if not self.restored or self.backup_workers:
            return sorted(self.pending)
        lowest = min(c.sync_step for c in self.pending.values())
        return sorted(r for r, c in self.pending.items() if c.sync_step == lowest)

    def _accounted(self) -> set[int]:
        """The ranks the pending step does not wait for a push of any more: those that
        pushed, and on a shard `restored`, those whose pushes are computed on a later step
        than the pending step's already (held over, or told when registering again: a
        worker blocked on the other shards' next step, which waits for the workers this
        one waits for, cannot push it again until they go on)."""
        present = set(self.pending)
        if self.restored and not self.backup_workers:
            lowest = min(c.sync_step for c in self.pending.values())
            present |= {r for r, step in self.stepping.items() if step > lowest}
        return present

    def _surely_short(self) -> bool:
        """Whether the pending step is short of its quorum by counts alone: the ranks
        accounted for are at most the pushes pending (and, on a shard `restored`, the ranks
        stepping ahead), and the step waits for at least the live ranks less those done or
        parked. Asked before the sets are built, since building them on every push made a
        step of n workers with a membership cost O(n²) (79 s for 100 steps of 1,024 in
        `advise --simulate` with failures)."""
        accounted = len(self.pending)
        if self.restored and not self.backup_workers:
            accounted += len(self.stepping)
        waiting = self._num_live() - len(self.done) - len(self.roster.parked)
        return accounted < max(1, waiting - self.backup_workers)

    def _num_live(self) -> int:
        """Live ranks of this run (all of them without a coordinator), counted once per
        membership the roster takes (a new set each time)."""
        live = self.roster.live
        if live is None:
            return self.world_size
        if self._live_counted[0] is not live or self._live_counted[1] != len(live):
            self._live_counted = (live, len(live), sum(1 for r in live if 0 <= r < self.world_size))
        return self._live_counted[2]

    def _maybe_complete_round(self, now: float, decision: Decision, rank: int | None = None) -> Decision:
        if self.mode != "sync" or not self.pending:
            return decision
        if not self.done and self.roster.live is None and not self.roster.parked:
            # Every rank counts (no coordinator, nobody done or parked): the same test as
            # below without building the set of n ranks on every push, which made a step
            # of 1,024 workers cost a third of a second here.
            needed = max(1, self.world_size - self.backup_workers)
            if len(self.pending) < needed and (not self.restored or len(self._accounted()) < needed):
                return decision
        else:
            if self._surely_short():
                return decision
            epoch = min(c.epoch for c in self.pending.values())
            waiting = self._waiting_for(epoch)
            if waiting and len(waiting & self._accounted()) < max(1, len(waiting) - self.backup_workers):
                return decision
            if self.roster.unregistered and not self.backup_workers:
                # A live worker this shard does not know yet (it restarted before its first
                # checkpoint): its push of this step is to come once it registers again.
                # Gone on without it, the step would be a step apart from the other
                # shards' for it, and it waited for one that waits for its next push.
                return decision
        ranks = self._this_step()
        contributions = [self.pending.pop(r) for r in ranks]
        real = [c for c in contributions if c.payload is not None]
        total = sum(c.weight for c in real)
        self.counts["samples"] += int(total)
        for c in real:
            c.weight /= total
            self._record(c.block)
        waited = now - (self.round_started if self.round_started is not None else now)
        self.round_wait_s += waited
        self.max_round_wait_s = max(self.max_round_wait_s, waited)
        self.round_started = now if self.pending else None  # pushes held over start the next step
        self.counts["applied"] += len(real)
        self.counts["steps"] += 1
        # max: a shard restored from an older checkpoint takes the run's count back
        self.sync_step = max([self.sync_step] + [c.sync_step for c in contributions]) + 1
        self.version += 1
        self.step_version, self.restored = self.version, False
        outcome = decision.outcome
        if outcome is Outcome.BUFFERED and (rank is None or rank in ranks):
            outcome = Outcome.APPLIED
        return Decision(outcome, self.version, decision.staleness, real, True, int(total))

    def status(self) -> dict[str, Any]:
        """Versions, membership and counters, by their `ShardStatus` names."""
        counts = self.counts
        return {"version": self.version, "world_size": self.world_size, "num_registered": len(self.ranks),
                "num_done": self._num_done(), "aggregation_mode": self.mode,
                **{f"num_{key}": counts[key] for key in ("applied", "rejected_stale", "dropped_late",
                                                         "duplicates")},
                "staleness_histogram": dict(self.staleness_histogram), "round_wait_s": self.round_wait_s,
                "max_round_wait_s": self.max_round_wait_s, "num_samples_applied": counts["samples"],
                "num_samples_duplicate": self.ledger.samples_duplicate,
                "num_blocks_applied": len(self.ledger.blocks), "num_fenced": self.roster.num_fenced,
                "generation": self.roster.generation}

    # -- undoing a refused update ---------------------------------------------------------

    def void(self, decision: Decision) -> None:
        """A step completed without a push (a worker left) whose update was refused: the
        version stays, so the workers waiting for it go on, but its blocks leave the
        ledger (each worker redoes them at its epoch's end) and its counts are taken back."""
        for c in decision.apply:
            self.ledger.blocks.discard(c.block)
        self.counts["applied"] -= len(decision.apply)
        self.counts["samples"] -= decision.samples

    def mark(self) -> tuple:
        """What `rollback` needs to undo the decisions that follow (no gradient is copied,
        nor the ledger: it journals what it adds)."""
        pending = {rank: replace(c) for rank, c in self.pending.items()}
        return (self._core_state(), self.ledger.mark(), pending, self.round_started, self.max_round_wait_s,
                dict(self.order.seen))

    def rollback(self, mark: tuple) -> None:
        """Undo every decision since `mark()`: version, ledger, counters, pending gradients."""
        state, ledger, pending, round_started, max_round_wait_s, self.order.seen = mark
        self._load_core_state(state)
        self.ledger.rollback(ledger)
        self.pending.update(pending)
        self.round_started, self.max_round_wait_s = round_started, max_round_wait_s

    # -- persistence ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything but pending gradients (a restarted shard's workers push them again)."""
        return {**self._core_state(), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Come back from a checkpoint: the shard is `restored` until its next synchronous
        step (the others may have gone on meanwhile).

        Raises:
            ValueError: the state was written in another mode.
        """
        if state["mode"] != self.mode:
            raise ValueError(f"the checkpoint was written in {state['mode']} mode, not {self.mode}")
        self._load_core_state(state)
        self.ledger.load_state_dict(state["ledger"])
        self.restart()

    def restart(self) -> None:
        """The shard's server restarted (from a checkpoint, or from nothing when it had
        written none): its step may lag the others' until its next synchronous step."""
        self.restored = self.mode == "sync"

    def _core_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "version": self.version, "sync_step": self.sync_step,
                "step_version": self.step_version, "restored": self.restored,
                "ranks": dict(self.ranks),
                # only SSP on steps keeps clocks: a sync or async step does not touch them
                **({"clocks": self.clocks.state_dict()} if self.bounds_steps else {}),
                "done": sorted(self.done), "last_step": dict(self.last_step),
                "round_wait_s": self.round_wait_s, "roster": self.roster.state_dict(),
                "staleness_histogram": dict(self.staleness_histogram), "counts": dict(self.counts)}

    def _load_core_state(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.sync_step = int(state["sync_step"])
        self.step_version = int(state["step_version"])
        self.restored = bool(state["restored"])
        self.ranks = {str(k): int(v) for k, v in state["ranks"].items()}
        self.done = {int(r) for r in state["done"]}
        self.clocks.load_state_dict(state.get("clocks", {}))  # kept by SSP on steps only
        self.last_step = {int(k): int(v) for k, v in state["last_step"].items()}
        self.round_wait_s = float(state["round_wait_s"])
        self.roster.load_state_dict(state["roster"])
        self.staleness_histogram = Counter({int(k): int(v) for k, v in state["staleness_histogram"].items()})
        self.counts = Counter({str(k): int(v) for k, v in state["counts"].items()})
        self.pending.clear()
        self.round_started = None
