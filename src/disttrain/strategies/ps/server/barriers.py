"""Named barriers of a parameter-server run: every worker arrives with a few numbers and
each leaves with everyone's (an all-gather through shard 0).

Pure bookkeeping, apart from any lock or transport: the servicer calls `arrive` under
its lock and waits on its condition variable until `result` is not None. A barrier is
complete once every rank of the run has arrived; its result is kept, so a worker that
arrives again (it was restarted) gets the same answer at once.

A barrier of a step (`arrive(..., step=k)`: the speed checks of a balanced run) is one
nobody must wait long for: it is given up, and every worker told so, once a worker that
has not arrived is behind (its last gradient is of an earlier step: it was restarted and
is redoing steps, or it is an asynchronous worker further back), or when any worker
re-registers or leaves. Waiting would then hold the others for no purpose, or for ever (a
synchronous worker behind needs their steps to catch up). A given-up result is kept too,
so every worker leaves with the same answer.

A barrier of no step does not wait for the workers the run reassigned (`excuse`: given up
on, their blocks taken over by the others): it completes once all the others arrived, and
an excused worker's row is NaN (as wide as the others'), so every worker learns from the
answer who was away.
"""

from __future__ import annotations

import math

from disttrain.strategies.ps.server.decisions import PushRefused

# Completed barriers are kept for late arrivals, bounded so a long run's memory stays
# flat. The speed checks come every few dozen steps and only a worker redoing the steps
# since its last checkpoint meets one again, so the oldest check goes first; then the
# oldest of the others (a few per epoch: the start, each epoch's end), which a restarted
# worker meets again whenever it starts.
MAX_KEPT = 256
# What one arrival may bring: a name (the project's are like "epoch12:evaluated"), a few
# figures (the widest, the run's final totals, has ten), and barriers in progress at once
# (a worker is at one at a time; a few names per worker leave room for restarts).
MAX_NAME_CHARS = 128
MAX_VALUES = 32
PENDING_PER_WORKER = 4


class BarrierMismatch(PushRefused):
    """A worker brought values of another length than those already there (refused as a
    push is: the call fails, nothing changes)."""


class InvalidBarrier(ValueError):
    """An arrival whose name or values break the bounds (INVALID_ARGUMENT): nothing changes."""


class TooManyBarriers(PushRefused):
    """A new barrier while as many are pending as the run allows: refused, nothing changes
    (retry once those complete)."""


def check_arrival(name: str, values: list[float]) -> None:
    """Raises InvalidBarrier for a name or values out of bounds: an empty or overlong
    name, one with control characters, too many values, or one NaN or infinite (the
    answer is checkpointed and read by every worker's planner)."""
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InvalidBarrier(f"barrier name must be 1 to {MAX_NAME_CHARS} printable characters, got "
                             f"{len(name)} characters")
    if len(values) > MAX_VALUES:
        raise InvalidBarrier(f"barrier {name!r}: {len(values)} values, at most {MAX_VALUES}")
    if not all(math.isfinite(v) for v in values):
        raise InvalidBarrier(f"barrier {name!r}: values must be finite (no NaN or infinity)")


class Barriers:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._arrived: dict[str, dict[int, list[float]]] = {}
        self._done: dict[str, list[list[float]]] = {}  # a given-up barrier: []
        self._checks: set[str] = set()  # the barriers of a step, pending or done
        self.excused: frozenset[int] = frozenset()  # ranks no barrier of no step waits for

    def arrive(self, name: str, rank: int, values: list[float], step: int = 0,
               last_steps: dict[int, int] | None = None) -> None:
        """Record `rank` at barrier `name` (again: its values are replaced). With `step`,
        the barrier is given up at once if a rank that has not arrived has a last step
        (`last_steps`) before it.

        Raises:
            InvalidBarrier: the name or values are out of bounds (`check_arrival`).
            BarrierMismatch: `values` differ in length from the others'.
            TooManyBarriers: `name` would be one pending barrier too many.
        """
        check_arrival(name, values)
        if name in self._done:
            return
        if name not in self._arrived and len(self._arrived) >= PENDING_PER_WORKER * self.world_size:
            raise TooManyBarriers(f"{len(self._arrived)} barriers are pending; barrier {name!r} must wait "
                                  "until one completes")
        arrived = self._arrived.setdefault(name, {})
        lengths = {len(v) for r, v in arrived.items() if r != rank}
        if lengths and lengths != {len(values)}:
            raise BarrierMismatch(f"barrier {name!r}: rank {rank} brought {len(values)} values, the "
                                  f"others {lengths.pop()}")
        arrived[rank] = list(values)
        if step > 0:
            self._checks.add(name)
        if len(arrived) == self.world_size:
            self._finish(name, [arrived[r] for r in range(self.world_size)])
        elif step == 0:
            self._finish_excused(name)
        else:
            last = last_steps or {}
            if any(last.get(r, 0) < step for r in range(self.world_size) if r not in arrived):
                self._finish(name, [])

    def _finish(self, name: str, rows: list[list[float]]) -> None:
        self._done[name] = rows
        del self._arrived[name]
        while len(self._done) > MAX_KEPT:
            oldest = next((n for n in self._done if n in self._checks), next(iter(self._done)))
            del self._done[oldest]
            self._checks.discard(oldest)

    def excuse(self, ranks: set[int] | frozenset[int]) -> None:
        """Wait no more for `ranks` (reassigned; a rank not in it is waited for again) at
        barriers of no step; those pending that now have everyone else complete."""
        self.excused = frozenset(ranks)
        for name in [n for n in self._arrived if n not in self._checks]:
            self._finish_excused(name)

    def _finish_excused(self, name: str) -> None:
        arrived = self._arrived[name]
        waited = [r for r in range(self.world_size) if r not in arrived and r not in self.excused]
        if not self.excused or waited:
            return
        width = len(next(iter(arrived.values())))
        self._finish(name, [arrived.get(r, [math.nan] * width) for r in range(self.world_size)])

    def give_up_pending(self) -> bool:
        """Give up every pending barrier of a step (a worker re-registered or left);
        whether there was one."""
        names = sorted(n for n in self._checks if n in self._arrived)
        for name in names:
            self._finish(name, [])
        return bool(names)

    def result(self, name: str) -> list[list[float]] | None:
        """Every rank's values in rank order once `name` is complete, [] once it was given
        up, else None."""
        return self._done.get(name)

    def state_dict(self) -> dict[str, list[list[float]]]:
        """The completed barriers (a restarted shard answers them again at once)."""
        return {name: [list(row) for row in rows] for name, rows in self._done.items()}

    def load_state_dict(self, state: dict[str, list[list[float]]]) -> None:
        self._done = {str(name): [[float(v) for v in row] for row in rows] for name, rows in state.items()}
