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

Shared per worker, and nothing pending for ever: a rank may be waiting at no more than
`PENDING_PER_WORKER` pending barriers at once (a worker is at one barrier at a time; the
rest is room for restarts), so a worker that makes up names takes only its own share of
the table and the others' barriers are never refused for it (`TooManyBarriers`,
RESOURCE_EXHAUSTED, names the worker and its barriers). An arrival is held by its
worker's wait: a waiting worker arrives again at every long-poll (at most every
`LONG_POLL_CAP_S`, and its client retries within seconds), and an arrival not renewed
for `EXPIRY_S` has lapsed: it still counts for the barrier (a worker that died waiting
is answered when it comes back, as before), but no longer for its worker's share. A
pending barrier at which every arrival has lapsed (nobody waits at it any more) expires:
it is forgotten, and a worker that arrives at it later starts it again (its values
taken again). Honest waits are never cut: a barrier waits as long as any worker waits at
it, and a worker absent for good (restarting, or taken over) is waited for until it
comes back or the run excuses it, as before; an expired one's late arrival waits anew.
"""

from __future__ import annotations

import math

from disttrain.strategies.ps.server.decisions import PushRefused
from disttrain.strategies.ps.server.limits import LONG_POLL_CAP_S

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
# An arrival not renewed for this long has lapsed: its worker stopped waiting. A worker
# waiting renews it at every long-poll (at most LONG_POLL_CAP_S, plus its client's backoff
# of at most a few seconds): three long-polls missed is not a wait.
EXPIRY_S = 3 * LONG_POLL_CAP_S


class BarrierMismatch(PushRefused):
    """A worker brought values of another length than those already there (refused as a
    push is: the call fails, nothing changes)."""


class InvalidBarrier(ValueError):
    """An arrival whose name or values break the bounds (INVALID_ARGUMENT): nothing changes."""


class TooManyBarriers(PushRefused):
    """A worker arrives at a new barrier while it waits at as many pending ones as a worker
    may (`PENDING_PER_WORKER`): refused (RESOURCE_EXHAUSTED), nothing changes.
    Recoverable: retry once one of them completes or lapses (`EXPIRY_S`)."""


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
    """The barriers of a run of `world_size` workers; an arrival lapses once not renewed
    for `expiry_s` (see the module)."""

    def __init__(self, world_size: int, expiry_s: float = EXPIRY_S):
        if expiry_s <= 0:
            raise ValueError(f"expiry_s must be > 0, got {expiry_s}")
        self.world_size = world_size
        self.expiry_s = expiry_s
        self._arrived: dict[str, dict[int, list[float]]] = {}
        self._renewed: dict[str, dict[int, float]] = {}  # pending barrier -> rank -> its last arrival
        self.num_expired = 0
        self._done: dict[str, list[list[float]]] = {}  # a given-up barrier: []
        self._checks: set[str] = set()  # the barriers of a step, pending or done
        self.excused: frozenset[int] = frozenset()  # ranks no barrier of no step waits for

    def arrive(self, name: str, rank: int, values: list[float], step: int = 0,
               last_steps: dict[int, int] | None = None, now: float = 0.0) -> None:
        """Record `rank` at barrier `name` at time `now` (again: its values are replaced,
        its arrival renewed). With `step`, the barrier is given up at once if a rank that
        has not arrived has a last step (`last_steps`) before it. Barriers nobody waits at
        any more expire first (`expire`).

        Raises:
            InvalidBarrier: the name or values are out of bounds (`check_arrival`).
            BarrierMismatch: `values` differ in length from the others'.
            TooManyBarriers: `rank` already waits at `PENDING_PER_WORKER` other pending barriers.
        """
        check_arrival(name, values)
        if name in self._done:
            return
        self.expire(now)
        arrived = self._arrived.get(name, {})
        if rank not in arrived:
            waiting = self.waiting(rank, now)
            if len(waiting) >= PENDING_PER_WORKER:
                shown = ", ".join(repr(n) for n in waiting)
                raise TooManyBarriers(f"rank {rank} already waits at {len(waiting)} pending barriers "
                                      f"({shown}), at most {PENDING_PER_WORKER} per worker; barrier {name!r} "
                                      f"must wait until one completes, or lapses {self.expiry_s:.0f}s after "
                                      "its last arrival")
        lengths = {len(v) for r, v in arrived.items() if r != rank}
        if lengths and lengths != {len(values)}:
            raise BarrierMismatch(f"barrier {name!r}: rank {rank} brought {len(values)} values, the "
                                  f"others {lengths.pop()}")
        arrived = self._arrived.setdefault(name, arrived)
        arrived[rank] = list(values)
        self._renewed.setdefault(name, {})[rank] = now
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

    def waiting(self, rank: int, now: float) -> list[str]:
        """The pending barriers at which `rank`'s arrival has not lapsed at `now`: its share."""
        return [name for name, renewed in self._renewed.items()
                if rank in renewed and now - renewed[rank] <= self.expiry_s]

    def expire(self, now: float) -> list[str]:
        """Forget the pending barriers at which every arrival lapsed at `now` (nobody waits
        at them any more); their names."""
        gone = [name for name, renewed in self._renewed.items()
                if all(now - t > self.expiry_s for t in renewed.values())]
        for name in gone:
            del self._arrived[name], self._renewed[name]
            self._checks.discard(name)
        self.num_expired += len(gone)
        return gone

    @property
    def pending(self) -> list[str]:
        """The names of the barriers pending now."""
        return list(self._arrived)

    def _finish(self, name: str, rows: list[list[float]]) -> None:
        self._done[name] = rows
        del self._arrived[name]
        self._renewed.pop(name, None)
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
