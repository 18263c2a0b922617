"""Local updates (`training.sync_every`) in a live group: rounds that a lost member rolls
back to their start.

Within a round each member steps its own model on its pieces of the round's global
batches, without communicating; at the round's end the members average their
pseudo-gradients (one flat all-reduce, or the run's compression hook) and every member
applies the outer optimizer alike (`training.local_updates`, as restart mode does). The
members' models differ within a round, so a member lost mid-round takes its part of the
round with it: nothing of the round can be kept. Every member therefore keeps the state
it held when the round began (model, inner optimizer, position; the ledger counts a
round's global batches only once it is averaged), and when the group changes mid-round
every survivor goes back to it and the new group redoes the round's global batches: none
lost, none applied twice. What a new generation hands a joiner, and what a checkpoint
holds, is that round-start state too.

Joiners are taken at round boundaries only (a joiner cannot take a member's half-trained
model), so a member checks for join tickets, a collective, once per round rather than
once per step: nothing crosses the network within a round.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from disttrain.compression.ddp_hooks import CompressionHook, average_flat
from disttrain.training.local_updates import LocalUpdates, OuterOptimizer


class LiveRounds:
    """One member's rounds: the outer optimizer (the same on every member) and the state
    the current round started from.

    Args:
        settings: H and the outer optimizer.
        params: the model's trained parameters, holding the run's start.
    """

    def __init__(self, settings: LocalUpdates, params: Sequence[torch.nn.Parameter]):
        self.settings = settings
        self.outer = OuterOptimizer(settings, params)
        self._start: dict[str, Any] | None = None  # the trainer's state when this round began

    @property
    def in_round(self) -> bool:
        """Whether a round is under way (its first step begun, its average not yet made)."""
        return self._start is not None

    @property
    def start_state(self) -> dict[str, Any] | None:
        """The trainer's state when the round under way began (None between rounds)."""
        return self._start

    def begin_step(self, state_of: Callable[[], dict[str, Any]]) -> None:
        """Call before each step: at a round's first, keep a copy of `state_of()`."""
        if not self.in_round:
            self._start = copy.deepcopy(state_of())

    def end_of_step(self, params: Sequence[torch.nn.Parameter], ends_epoch: bool,
                    compression: CompressionHook | None) -> float | None:
        """Call after each inner step: at a round's end (H steps, or the epoch's last)
        average the pseudo-gradient over the group and step the outer optimizer; the
        parameters then hold the next round's start. Returns the seconds the average took
        (None within a round).

        Raises:
            RuntimeError, dist.DistError: a peer was lost (the caller rolls back).
        """
        if not self.outer.end_of_step(ends_epoch):
            return None
        started = time.perf_counter()
        average = average_flat(self.outer.pseudo_gradient(params), list(params), compression)
        self.outer.step(average)
        self.outer.copy_to(params)
        self._start = None
        return time.perf_counter() - started

    def rollback(self) -> dict[str, Any] | None:
        """The group changed: the round under way is given up. Returns the state it began
        from, for the trainer to load (None between rounds: nothing to give up)."""
        start = self._start
        self.outer.steps_in_round = 0
        self._start = None
        return start

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer at the round's start (its state changes only at a round's end)."""
        return {**self.outer.state_dict(), "steps_in_round": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's (or a checkpoint's) `state_dict`; a round under way here is given up.

        Raises:
            ValueError: it does not fit this run's model or outer optimizer.
        """
        self.outer.load_state_dict(state)
        self.outer.steps_in_round = 0
        self._start = None

    def summary_fields(self) -> dict[str, Any]:
        return {**self.settings.summary_fields(), "local_rounds": self.outer.rounds}
