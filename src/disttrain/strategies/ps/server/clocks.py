"""SSP's clocks (Ho et al., NIPS 2013): how many steps each worker has pushed, and
whether a worker may run on.

A worker's clock is the highest step it has pushed (its own steps, counted by the
training loop over the whole run). The bound tau is on clocks, not versions: a worker
whose push of step s has `s - slowest > tau`, `slowest` being the lowest clock of the
workers that still count, waits before it computes again (the shard holds its reply);
the slowest worker is never held, so the run cannot wait for itself. tau = 0 puts every
worker in lockstep (each step computed on parameters holding every worker's previous
step, as in sync); a bound beyond the run's steps never holds anyone (async). No push is
refused for staleness.

Who counts is the sync barrier's rule (`AggregationRules._waiting_for`): a worker that is
done, that the coordinator declared failed or reassigned, or that pushed its last block
of the push's epoch no longer holds anyone back. A worker not heard from yet counts at
clock 0, as a synchronous step waits for it.

Pure bookkeeping: the rules decide with it under the shard's lock. The lowest clock is
kept by a count of the clocks of the workers counted (live, not done), so that checking a
push costs a few operations, not a pass over every worker: clocks stay within tau of
each other, so the count holds a few values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable


class StepClocks:
    """The clocks of the ranks of a run of `world_size` workers (see the module)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.clocks: dict[int, int] = {}
        self._counted: Counter[int] | None = None  # clock -> ranks counted at it (None: to rebuild)
        self._members: set[int] = set()

    def tick(self, rank: int, step: int) -> bool:
        """`rank` pushed `step`; whether its clock moved on."""
        old = self.clocks.get(rank, 0)
        if step <= old:
            return False
        self.clocks[rank] = step
        counted = self._counted
        if counted is not None and rank in self._members:
            counted[old] -= 1
            if not counted[old]:
                del counted[old]
            counted[step] += 1
        return True

    def of(self, rank: int) -> int:
        return self.clocks.get(rank, 0)

    def changed(self) -> None:
        """Who counts changed (membership, a worker done, a restore): rebuilt on next use."""
        self._counted = None

    def slowest(self, counts: Callable[[int], bool], excluded: Iterable[int] = ()) -> int | None:
        """The lowest clock among the ranks for which `counts(rank)` holds and that are not
        `excluded` (None: no rank counts). `counts` must change only with `changed()`;
        `excluded` (the ranks parked for an epoch) is read at every call."""
        if self._counted is None:
            self._members = {r for r in range(self.world_size) if counts(r)}
            self._counted = Counter(self.clocks.get(r, 0) for r in self._members)
        excluded = set(excluded) & self._members
        if not excluded:
            return min(self._counted, default=None)
        return min((self.clocks.get(r, 0) for r in self._members - excluded), default=None)

    def state_dict(self) -> dict[str, int]:
        return {str(rank): step for rank, step in self.clocks.items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.clocks = {int(rank): int(step) for rank, step in state.items()}
        self._counted = None
