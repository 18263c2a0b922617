"""A live rank's recovery policy for the one DDP participant in the training loop
(`ddp.participant.DDPParticipant`, which restart mode runs too): the step boundary where
the group may change, and the checkpoint pieces of one generation of its group; and the
store its leader alone writes.

A generation's run of the loop ends at a step boundary where the group changes (ranks
ask to join, members leave: `GroupChanges`), or where a collective fails because a peer
was lost (the collective's own error); `LiveRank` then forms the next generation, syncs
the furthest holder's state and runs the loop again from it, as on a resume.

The speed a balanced member measures (`LiveTrainer.after_step`) covers everything that
slows its step, the loop's straggler fault included, so it is counted when the loop
comes back to the participant: before the next step's boundary, or before the epoch's
evaluation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disttrain.core.errors import CheckpointError, DistributedError
from disttrain.strategies.ddp.live.checkpoints import LiveCheckpoints
from disttrain.strategies.ddp.live.group import LiveGroup
from disttrain.strategies.ddp.live.membership import Change, below_minimum
from disttrain.strategies.ddp.live.trainer import LiveTrainer
from disttrain.training.engine import EvalResult
from disttrain.training.loop import LOOP_KEYS

logger = logging.getLogger(__name__)

# The loop's pieces of a checkpoint that a live one leaves out: its leave and last
# checkpoints hold the group's state alone (`LiveRank`), and so do its periodic ones.
PROCESS_KEYS = (*LOOP_KEYS, "config")
MINIMUM_POLL_S = 1.0  # a group below its minimum looks for arrivals this often (a collective each)


class GroupChanges(Exception):
    """At this step boundary the group changes (`change`: ranks join, members leave):
    the generation's run of the loop ends here, every member at the same step."""

    def __init__(self, change: Change):
        super().__init__(f"the group changes: {change}")
        self.change = change


class LiveRecovery:
    """Live recovery's policy for the one DDP participant (`ddp.participant.DDPParticipant`)
    in a generation: at each step boundary the group may change, and a checkpoint holds
    the group's state (`LiveTrainer`: the run's position and data ledger with the model).

    Args:
        trainer: the rank's model, optimizer, data and the run's progress (attached to
            the generation's group).
        group: the rank's live group, formed for this generation.
        min_world_size: an elastic run's minimum (0: none); a group below it waits at a
            step boundary for a rank to join.
        report: called after each step (the launcher's count of the group's steps).
    """

    strategy = "ddp-live"

    def __init__(self, trainer: LiveTrainer, group: LiveGroup, min_world_size: int,
                 report: Callable[[int], None]):
        self.trainer, self.group, self.min_world_size, self.report = trainer, group, min_world_size, report
        self._uncounted: tuple[int, float] | None = None  # the last step's (samples, joins_wait_s)
        self._step: tuple[int, float] = (0, 0.0)  # the step under way's (samples, joins_wait_s)

    def start(self) -> None:
        """Nothing to set up: the generation's group was formed and its state synced."""

    def place(self) -> tuple[int, int]:
        """This member's place in the generation (counting the last step's speed first)."""
        self._count_last_step()
        return self.group.rank, self.group.world_size

    def begin_step(self, samples: int) -> torch.nn.Module:
        """Take the group's changes at this boundary; then the module the step trains
        through (`LiveTrainer.begin_step`).

        Raises:
            GroupChanges: ranks join or members leave here (every member raises it).
            DistributedError: an elastic group below its minimum waited `ddp.timeout_s`
                for a rank to join.
            RuntimeError, dist.DistError: a peer was lost in a collective.
        """
        trainer, progress = self.trainer, self.trainer.progress
        self._count_last_step()
        joins_wait_s = 0.0
        if trainer.at_round_boundary:  # with local updates, joiners come between rounds
            started = time.perf_counter()
            change = self._boundary()
            joins_wait_s = time.perf_counter() - started  # mostly waiting for the slowest member
            if change.changes(progress.admitted):  # every member sees the same: all change the group
                progress.admitted = change.tickets
                raise GroupChanges(change)
        self._step = (samples, joins_wait_s)
        return trainer.begin_step(samples)

    def end_step(self, batches: int, scalars: dict[str, float]) -> None:
        """The ledger and the run's position past the step (`LiveTrainer.end_step`); its
        speed is counted when the loop comes back (see the module's docstring)."""
        self.trainer.end_step(batches, scalars)
        self.report(self.trainer.progress.step)
        self._uncounted = self._step

    def evaluated(self, result: EvalResult) -> None:
        self.trainer.evaluated(result)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def _count_last_step(self) -> None:
        """Under `system.balance`: this member's speed over the last step, everything after
        it that slowed it included (a re-plan at a check is a collective)."""
        uncounted, self._uncounted = self._uncounted, None
        if uncounted is not None:
            self.trainer.after_step(*uncounted)

    def _boundary(self) -> Change:
        """What changes at this step boundary (a collective). A group of an elastic run
        below its minimum (`--world-size MIN:MAX`) trains nothing until a rank joins (a
        restarted one, or one started by hand), within `ddp.timeout_s`.

        Raises:
            DistributedError: nobody joined within `ddp.timeout_s`.
        """
        group, admitted = self.group, self.trainer.progress.admitted
        change = group.pending_changes(admitted, group.leave_requested)
        deadline = None
        while not change.changes(admitted) and below_minimum(group.world_size, self.min_world_size):
            if deadline is None:
                deadline = time.monotonic() + group.timeout_s
                logger.warning("generation %d has %d rank(s), below the run's minimum of %d: it waits for a "
                               "rank to join before training on", group.generation, group.world_size,
                               self.min_world_size)
            elif time.monotonic() > deadline:
                raise DistributedError(f"the group has {group.world_size} rank(s), below the minimum of "
                                       f"{self.min_world_size} (--world-size MIN:MAX), and none joined "
                                       f"within {group.timeout_s:g}s (ddp.timeout_s); start one with --join")
            change = group.pending_changes(admitted, group.leave_requested, wait_s=MINIMUM_POLL_S)
        return change


class LeaderStore:
    """The loop's checkpoint store in a generation: every member holds the same state, so
    the generation's leader alone writes it (`LiveCheckpoints`, in the background), the
    group's pieces only (the loop's sampler and RNG are one process's, not the run's).
    A generation never starts from a file: `--resume` and a generation in which nobody
    holds state read one before the state is synced (`LiveRank`).

    Args:
        checkpoints: the rank's checkpoint writer.
        is_leader: whether this member leads the generation.
    """

    def __init__(self, checkpoints: LiveCheckpoints, is_leader: bool):
        self.checkpoints, self.is_leader = checkpoints, is_leader

    def choose(self, resume: bool) -> Path | None:
        return None

    def load(self, path: Path) -> dict[str, Any]:
        raise CheckpointError(f"{path}: a live generation takes its state from its members, not a file")

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.is_leader:
            self.checkpoints.save(step, {key: item for key, item in state.items() if key not in PROCESS_KEYS})
