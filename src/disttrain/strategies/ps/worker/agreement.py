"""One step across shards: the rule a worker in sync mode follows so that it never
computes a gradient on parameters of different steps.

Each shard applies a synchronous step on its own, and answers each worker as soon as it
has. So a worker may hold shard A's parameters after step s + 1 while shard B, slow or
cut off from the workers, still holds step s: a worker that went on with what it holds
(a restarted worker's first pull, a shard re-pulled after a refused push or a redone
block) would compute its next gradient on a model that never existed, half one step and
half the next.

Every parameter answer carries the run's step it is the result of (`sync_step`: the
synchronous steps the shard applied, the same number on every shard for the same step;
see `server.aggregation`). Before a worker computes, the steps of every shard it holds
must be equal. When they are not, the shards behind the highest step are pulled again,
each waiting (a long-poll) for the version that step brings it to: its held version
plus the steps it lacks (a shard's versions count its steps, and blocks redone after a
failure on top). A shard that overtakes the others in the meantime raises the target.
The wait is bounded by a deadline: past it the step fails with `StepsDisagree` (the
worker stops; restarted by its supervisor, it pulls again), never trains on the mix.
A shard may wait for the very worker that waits for it: one that restarted after its
push of a step reached shard A but not shard B. That worker first tells B its push will
not come (a stand-in, `SyncExchange.stand_in`), and B applies the step without it.

One case keeps parameters of different steps by design: a shard restored from an older
checkpoint has lost steps the others kept, and no wait brings them back (they are redone
as blocks, `WorkerParticipant.redo_missing`). The shard says so itself: every answer of
it is `restored` until it applies a synchronous step. Such a shard is never waited for:
its first step after the restore is computed on what it came back with; the pushes of
that step name the highest step their worker holds, and the shard counts that step on
from there (see `server.aggregation`), so the steps agree again from the next one. The
decision rests on the shard's answer, the same for every worker, not on what a worker
remembers: a worker restarted after the restore, or one that learnt of it by a pull
rather than by a push turned back, decides as the others do. A shard that turned a
worker's push back is not waited for either before the worker pushes its part again
(`SyncExchange.agree`'s `pushing`): restored, it may have gone on a step without that
worker (restarted then, a step on elsewhere) and wait for that very push.

After a step, every shard must have applied it (`floor`: one past the step the pushes
were computed on): an answer that came before the step was applied on some shard (a
block redone there moved its version on meanwhile) is pulled again like a shard behind.

Pure: the clock is passed in; the exchange does the pulls (`SyncExchange.agree`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disttrain.core.errors import DistributedError


class StepsDisagree(DistributedError):
    """The shards' answers stayed at different steps past the deadline. Recoverable by a
    restart: nothing of the step was computed on them."""


@dataclass(frozen=True)
class Lag:
    """Shards behind the highest step: `wait_for` maps each to the version it must be
    pulled at (the version that brings it to `target`)."""

    target: int
    wait_for: dict[int, int]


def lag(steps: Sequence[int], versions: Sequence[int], restored: Sequence[int] = (), floor: int = 0) -> Lag:
    """Which shards are behind the highest of `steps` (and of `floor`), and the version
    each must reach; a shard in `restored` lags by design and is never waited for.

    Args:
        steps: per shard, the step of the parameters held (`sync_step` of its answer).
        versions: per shard, the version of the parameters held.
        restored: the shards whose answer said they were restored (`restored`).
        floor: the lowest step every shard must be at (0: none).
    Raises:
        ValueError: the lists differ in length, or are empty.
    """
    if len(steps) != len(versions) or not steps:
        raise ValueError(f"{len(steps)} steps for {len(versions)} versions")
    target = max(max(steps), floor)
    return Lag(target, {s: versions[s] + target - step for s, step in enumerate(steps)
                        if step < target and s not in restored})


class Agreement:
    """The bounded wait for every shard to reach one step.

    Args:
        deadline_s: how long shards may disagree, from the first disagreement seen in a
            wait, before the step fails.
    """

    def __init__(self, deadline_s: float):
        if deadline_s <= 0:
            raise ValueError(f"the deadline must be positive, got {deadline_s}")
        self.deadline_s = deadline_s
        self.num_waits = 0  # waits for a shard behind (each ended in agreement or a failure)
        self._since: float | None = None

    def check(self, steps: Sequence[int], versions: Sequence[int], now: float, restored: Sequence[int] = (),
              floor: int = 0, shards: Sequence[int] | None = None) -> Lag:
        """What to pull before computing: an empty `wait_for` once every shard is at one
        step, at `floor` at least, but those `restored` (see `lag`). `shards`: the run's
        numbers of the shards the lists are of, for the message (None: 0 on).

        Raises:
            StepsDisagree: the shards still disagree `deadline_s` after this wait began;
                the message names each shard's step and version.
        """
        behind = lag(steps, versions, restored, floor)
        if not behind.wait_for:
            self._since = None
            return behind
        if self._since is None:
            self._since = now
            self.num_waits += 1
        elif now - self._since >= self.deadline_s:
            raise self.failure(steps, versions, restored=restored, floor=floor, shards=shards)
        return behind

    def failure(self, steps: Sequence[int], versions: Sequence[int], cause: str = "",
                restored: Sequence[int] = (), floor: int = 0, shards: Sequence[int] | None = None
                ) -> StepsDisagree:
        """The error that ends a wait the shards did not agree in (the wait is over).
        `shards`: the run's numbers of the shards the lists are of (None: 0 on)."""
        self._since = None
        behind = lag(steps, versions, restored, floor)
        names = list(shards) if shards is not None else list(range(len(steps)))
        held = ", ".join(f"shard {names[s]} step {step} (version {versions[s]})"
                         for s, step in enumerate(steps))
        return StepsDisagree(
            f"the shards did not reach one step within {self.deadline_s:g}s ({held}): shard(s) "
            f"{sorted(names[s] for s in behind.wait_for)} stayed behind step {behind.target}, so this worker "
            "stops rather than compute a gradient on parameters of different steps; check the network to "
            "those servers"
            + (f" ({cause})" if cause else ""))

    def remaining_s(self, now: float) -> float:
        """Seconds left of the wait in progress (the whole deadline when none is)."""
        return self.deadline_s if self._since is None else max(self.deadline_s - (now - self._since), 0.0)
