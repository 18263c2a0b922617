"""Warnings an outsider can cause, written at a bounded rate: a refused call logs one
line per kind (a method, a status code) every `interval_s` at most, and the next line of
that kind says how many were left out meanwhile. Without it, a client that repeats a
refused call as fast as it can fills the server's log and disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

# Kinds remembered at once: a flood of distinct kinds (method names are fixed, but a
# caller may vary what it sends) never grows the table past this.
MAX_KINDS = 256


class RateLimitedLog:
    """Logs at most one warning per kind every `interval_s` (thread-safe).

    Args:
        logger: where the lines go.
        interval_s: the least time between two lines of one kind.
        clock: returns seconds (tests step it by hand).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, clock=time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()

    def warning(self, kind: str, message: str, *args) -> bool:
        """Log `message % args` unless a line of `kind` was written within `interval_s`
        (then count it); whether it was written."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._skipped[kind] += 1
                return False
            if kind not in self._last and len(self._last) >= MAX_KINDS:
                oldest = min(self._last, key=self._last.__getitem__)
                del self._last[oldest]
                self._skipped.pop(oldest, None)
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        if skipped:
            message += f" (and {skipped} more like it in the last {self.interval_s:.0f}s)"
        self.logger.warning(message, *args)
        return True
