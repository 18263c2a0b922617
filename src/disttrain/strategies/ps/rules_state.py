"""What the aggregation rules save with a shard's checkpoint, and how they undo the
decisions of an update the shard refused (it would have left a parameter non-finite)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from disttrain.strategies.ps.decisions import Contribution, Decision, StepOrder
from disttrain.strategies.ps.roster import Ledger, Roster


class RulesState:
    """The saving and undoing half of `AggregationRules` (which sets these fields)."""

    if TYPE_CHECKING:
        mode: str
        version: int
        ranks: dict[str, int]
        done: set[int]
        last_step: dict[int, int]
        pending: dict[int, Contribution]
        ledger: Ledger
        roster: Roster
        order: StepOrder
        round_started: float | None
        round_wait_s: float
        max_round_wait_s: float
        staleness_histogram: Counter[int]
        counts: Counter[str]

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
        """Raises ValueError when the state was written in another mode."""
        if state["mode"] != self.mode:
            raise ValueError(f"the checkpoint was written in {state['mode']} mode, not {self.mode}")
        self._load_core_state(state)
        self.ledger.load_state_dict(state["ledger"])

    def _core_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "version": self.version, "ranks": dict(self.ranks),
                "done": sorted(self.done), "last_step": dict(self.last_step),
                "round_wait_s": self.round_wait_s, "roster": self.roster.state_dict(),
                "staleness_histogram": dict(self.staleness_histogram), "counts": dict(self.counts)}

    def _load_core_state(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.ranks = {str(k): int(v) for k, v in state["ranks"].items()}
        self.done = {int(r) for r in state["done"]}
        self.last_step = {int(k): int(v) for k, v in state["last_step"].items()}
        self.round_wait_s = float(state["round_wait_s"])
        self.roster.load_state_dict(state["roster"])
        self.staleness_histogram = Counter({int(k): int(v) for k, v in state["staleness_histogram"].items()})
        self.counts = Counter({str(k): int(v) for k, v in state["counts"].items()})
        self.pending.clear()
        self.round_started = None
