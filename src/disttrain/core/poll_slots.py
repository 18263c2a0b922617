"""Slots for long-polls: calls that hold one of a gRPC server's handler threads while they
wait. Without bounds, a few dozen waits for something that never comes take every
thread, and a status call or a heartbeat then waits behind them. So each long-poll takes
a slot first: a key (what the wait is for: a worker's pulls, its pushes, its watch) holds
at most `per_key` at once, a caller (`owner`: the node its credentials name) at most
`per_owner` over all its keys, and all of them together leave `reserved_threads` of the
pool free for calls that answer at once. A long-poll over a cap is refused before it
waits (the server answers RESOURCE_EXHAUSTED), so one caller takes only its own share
and a caller beside it is served.

`caller_key` names the share a call is made under: the node its credentials name, or
one share for the trusted (the operator, or anyone on a server without credentials).
"""

from __future__ import annotations

import threading
from collections import Counter

from disttrain.core.identity import Caller


def reserved_threads(max_threads: int) -> int:
    """Handler threads kept free of long-polls: a quarter of the pool, at least 2."""
    return max(2, max_threads // 4)


def caller_key(caller: Caller | None) -> str | None:
    """The share of `caller`: its node and role; None for the operator and for a caller
    of a server without credentials (trusted: bounded by the totals alone)."""
    if caller is None or caller.is_operator:
        return None
    return str(caller)


class PollLimitExceeded(RuntimeError):
    """A long-poll over a cap: refused before it waited (recoverable: retry later)."""


class PollSlots:
    """Counts the long-polls in progress, per key, per owner (a caller) and in total.

    Args:
        max_total: long-polls at once, over all keys.
        per_key: long-polls at once with one key.
        per_owner: long-polls at once of one owner, over all its keys (None: no bound
            beyond the keys').
    """

    def __init__(self, max_total: int, per_key: int = 2, per_owner: int | None = None):
        if max_total < 1 or per_key < 1 or (per_owner is not None and per_owner < 1):
            raise ValueError(f"max_total ({max_total}), per_key ({per_key}) and per_owner ({per_owner}) "
                             "must be >= 1")
        self.max_total = max_total
        self.per_key = per_key
        self.per_owner = per_owner
        self._lock = threading.Condition()
        self._held: Counter[str] = Counter()
        self._owned: Counter[str] = Counter()
        self._total = 0

    @classmethod
    def for_pool(cls, max_threads: int, per_key: int = 2, per_owner: int | None = None) -> PollSlots:
        """Slots for a server of `max_threads` handler threads, `reserved_threads` kept free."""
        return cls(max(1, max_threads - reserved_threads(max_threads)), per_key, per_owner)

    def take(self, key: str, per_key: int | None = None, owner: str | None = None) -> _Slot:
        """A slot for one long-poll of `key` by `owner` (None: a trusted caller, bounded by
        the key's cap and the total alone), released when its `with` block ends.

        Raises:
            PollLimitExceeded: `key`, `owner` or the server already holds as many as allowed.

        `per_key` replaces the cap of this key.
        """
        cap = self.per_key if per_key is None else per_key
        with self._lock:
            if self._held[key] >= cap:
                raise PollLimitExceeded(f"{key!r} already has {self._held[key]} long-polls waiting on "
                                        f"this server (at most {cap}); retry once one ended")
            if owner is not None and self.per_owner is not None and self._owned[owner] >= self.per_owner:
                raise PollLimitExceeded(f"{owner} already holds {self._owned[owner]} long-polls on this "
                                        f"server (at most {self.per_owner} per caller); retry once one ended")
            if self._total >= self.max_total:
                raise PollLimitExceeded(f"this server already holds {self._total} long-polls (at most "
                                        f"{self.max_total}); retry later")
            self._held[key] += 1
            if owner is not None:
                self._owned[owner] += 1
            self._total += 1
            self._lock.notify_all()
        return _Slot(self, key, owner)

    def _release(self, key: str, owner: str | None) -> None:
        with self._lock:
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
            if owner is not None:
                self._owned[owner] -= 1
                if not self._owned[owner]:
                    del self._owned[owner]
            self._total -= 1
            self._lock.notify_all()

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def held(self, key: str) -> int:
        """Long-polls of `key` in progress now."""
        with self._lock:
            return self._held[key]

    def held_by(self, owner: str) -> int:
        """Long-polls `owner` holds now, over all its keys."""
        with self._lock:
            return self._owned[owner]

    def wait_for_total(self, num: int, timeout_s: float) -> bool:
        """Wait until exactly `num` long-polls are in progress; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._total == num, timeout_s)


class _Slot:
    def __init__(self, slots: PollSlots, key: str, owner: str | None):
        self._slots, self._key, self._owner = slots, key, owner

    def __enter__(self) -> _Slot:
        return self

    def __exit__(self, *exc) -> None:
        self._slots._release(self._key, self._owner)
