"""Named barriers of a parameter-server run: every worker arrives with a few numbers and
each leaves with everyone's (an all-gather through shard 0).

Pure bookkeeping, apart from any lock or transport: the servicer calls `arrive` under
its lock and waits on its condition variable until `result` is not None. A barrier is
complete once every rank of the run has arrived; its result is kept, so a worker that
arrives again (it was restarted) gets the same answer at once.
"""

from __future__ import annotations

# A run meets at a few barriers per epoch; completed ones are kept for late arrivals,
# bounded so a long run's memory stays flat (the oldest are dropped first).
MAX_KEPT = 256


class BarrierMismatch(ValueError):
    """A worker brought values of another length than those already there."""


class Barriers:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._arrived: dict[str, dict[int, list[float]]] = {}
        self._done: dict[str, list[list[float]]] = {}

    def arrive(self, name: str, rank: int, values: list[float]) -> None:
        """Record `rank` at barrier `name` (again: its values are replaced).

        Raises:
            BarrierMismatch: `values` differ in length from the others'.
        """
        if name in self._done:
            return
        arrived = self._arrived.setdefault(name, {})
        lengths = {len(v) for r, v in arrived.items() if r != rank}
        if lengths and lengths != {len(values)}:
            raise BarrierMismatch(f"barrier {name!r}: rank {rank} brought {len(values)} values, the "
                                  f"others {lengths.pop()}")
        arrived[rank] = list(values)
        if len(arrived) == self.world_size:
            self._done[name] = [arrived[r] for r in range(self.world_size)]
            del self._arrived[name]
            while len(self._done) > MAX_KEPT:
                self._done.pop(next(iter(self._done)))

    def result(self, name: str) -> list[list[float]] | None:
        """Every rank's values in rank order once `name` is complete, else None."""
        return self._done.get(name)

    def state_dict(self) -> dict[str, list[list[float]]]:
        """The completed barriers (a restarted shard answers them again at once)."""
        return {name: [list(row) for row in rows] for name, rows in self._done.items()}

    def load_state_dict(self, state: dict[str, list[list[float]]]) -> None:
        self._done = {str(name): [[float(v) for v in row] for row in rows] for name, rows in state.items()}
