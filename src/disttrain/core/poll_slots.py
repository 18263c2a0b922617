"""Slots for long-polls: calls that hold one of a gRPC server's handler threads while they
wait. Without bounds, a few dozen waits for something that never comes take every
thread, and a status call or a heartbeat then waits behind them. So each long-poll takes
a slot first: a key (a worker id) holds at most `per_key` at once, and all of them
together leave `reserved_threads` of the pool free for calls that answer at once. A
long-poll over a cap is refused before it waits (the server answers RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import threading
from collections import Counter


def reserved_threads(max_threads: int) -> int:
    """Handler threads kept free of long-polls: a quarter of the pool, at least 2."""
    return max(2, max_threads // 4)


class PollLimitExceeded(RuntimeError):
    """A long-poll over a cap: refused before it waited (recoverable: retry later)."""


class PollSlots:
    """Counts the long-polls in progress, per key (a worker id) and in total.

    Args:
        max_total: long-polls at once, over all keys.
        per_key: long-polls at once with one key.
    """

    def __init__(self, max_total: int, per_key: int = 2):
        if max_total < 1 or per_key < 1:
            raise ValueError(f"max_total ({max_total}) and per_key ({per_key}) must be >= 1")
        self.max_total = max_total
        self.per_key = per_key
        self._lock = threading.Condition()
        self._held: Counter[str] = Counter()
        self._total = 0

    @classmethod
    def for_pool(cls, max_threads: int, per_key: int = 2) -> PollSlots:
        """Slots for a server of `max_threads` handler threads, `reserved_threads` kept free."""
        return cls(max(1, max_threads - reserved_threads(max_threads)), per_key)

    def take(self, key: str, per_key: int | None = None) -> _Slot:
        """A slot for one long-poll of `key`, released when its `with` block ends.

        Raises:
            PollLimitExceeded: `key` or the server already holds as many as allowed.

        `per_key` replaces the cap of this key (a key shared by callers not yet known).
        """
        cap = self.per_key if per_key is None else per_key
        with self._lock:
            if self._held[key] >= cap:
                raise PollLimitExceeded(f"{key!r} already has {self._held[key]} long-polls waiting on "
                                        f"this server (at most {cap}); retry once one ended")
            if self._total >= self.max_total:
                raise PollLimitExceeded(f"this server already holds {self._total} long-polls (at most "
                                        f"{self.max_total}); retry later")
            self._held[key] += 1
            self._total += 1
            self._lock.notify_all()
        return _Slot(self, key)

    def _release(self, key: str) -> None:
        with self._lock:
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
            self._total -= 1
            self._lock.notify_all()

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def wait_for_total(self, num: int, timeout_s: float) -> bool:
        """Wait until exactly `num` long-polls are in progress; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._total == num, timeout_s)


class _Slot:
    def __init__(self, slots: PollSlots, key: str):
        self._slots, self._key = slots, key

    def __enter__(self) -> _Slot:
        return self

    def __exit__(self, *exc) -> None:
        self._slots._release(self._key)
