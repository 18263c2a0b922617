"""What the aggregation rules read of a push, and what they decide to do with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Outcome(Enum):
    APPLIED = 0     # applied now (async, ssp), or completed a synchronous step
    BUFFERED = 1    # held for the rest of a synchronous step
    STALE = 2       # ssp: too stale; refetch and recompute
    LATE = 3        # sync: its step was applied without it; dropped
    DUPLICATE = 4   # this push or its block was taken before; nothing changed
    ROLLED_BACK = 5  # the shard is behind the push's base version (it restarted)


class PushRefused(ValueError):
    """A push that breaks the protocol (unknown worker, a second gradient of one worker
    for one synchronous step). Nothing changes."""


@dataclass(frozen=True)
class Push:
    """What the rules read of a push (the payload travels beside it)."""

    worker_id: str
    step: int
    base_version: int
    weight: float
    block: int = -1
    epoch: int = 0
    last_in_epoch: bool = False
    generation: int = 0
    redo: bool = False
    sync_step: int = 0  # the run's step of the parameters the gradient was computed on (sync)
    stand_in: bool = False  # no gradient: the worker's push of the pending step will not come


@dataclass
class Contribution:
    rank: int
    weight: float
    payload: Any  # None: a duplicate block that stands in for its worker in a sync step
    block: int = -1
    epoch: int = 0
    sync_step: int = 0  # the push's (see `Push.sync_step`)


@dataclass
class Decision:
    """What to do with a push. `apply` lists the gradients to combine now (by weight,
    in rank order); `advanced` says the version went up (possibly with nothing to apply).
    `learning_rate` is the shard's to fill in (the rules know no optimizer): the rate of
    the update that applied the push, or will apply the synchronous step it joined."""

    outcome: Outcome
    version: int
    staleness: int
    apply: list[Contribution] = field(default_factory=list)
    advanced: bool = False
    samples: int = 0  # the samples `apply` stands for, as counted applied
    learning_rate: float = 0.0
