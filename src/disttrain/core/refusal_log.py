"""Refused calls logged without letting a caller flood the log or the terminal: at most
one warning per key (a caller, or a kind of refusal) per period, which counts the
refusals it stands for, and what a caller sent printed with its control characters
escaped (`printable`). `RefusalLog` is the rule, its clock passed in; `RateLimitedLog`
writes a logger's lines by it. Both thread-safe (a server's handler threads share one).

A caller the server knows (the node its credentials name) has a key of its own
(`RefusalLog.of`), wherever it calls from: one caller's refusals never silence another's
line, even from the same host, and it cannot make the log forget others by calling from
many addresses; a caller the server cannot tell apart is keyed by its host."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

PERIOD_S = 10.0  # one warning per caller per this many seconds
MAX_CALLERS = 1024  # callers remembered; past it the one logged longest ago is forgotten
# Kinds a RateLimitedLog remembers (method names are fixed, but a caller may vary what it
# sends): a flood of distinct kinds never grows the table past this.
MAX_KINDS = 256
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with every character Python does not call printable escaped (controls such
    as \\x1b and \\n, line and paragraph separators, bidirectional overrides: \\u2028,
    \\u202e), safe for a terminal or a log line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class RefusalLog:
    """Which refusals to log.

    Args:
        period_s: a caller's next refusal is logged this long after its last logged one.
        max_callers: callers remembered at once (a flood of addresses cannot grow it).
    """

    def __init__(self, period_s: float = PERIOD_S, max_callers: int = MAX_CALLERS):
        self.period_s = period_s
        self.max_callers = max_callers
        self._callers: dict[str, tuple[float, int]] = {}  # caller -> (last logged, refusals since)
        self._lock = threading.Lock()

    def refused(self, caller: str, now: float) -> int:
        """Note a refusal of `caller`'s call at `now`. Returns how many refusals a warning
        logged now stands for (this one and those kept quiet since the last), or 0: stay quiet."""
        with self._lock:
            logged_at, quiet = self._callers.get(caller, (float("-inf"), 0))
            if now - logged_at < self.period_s:
                self._callers[caller] = (logged_at, quiet + 1)
                return 0
            if caller not in self._callers and len(self._callers) >= self.max_callers:
                del self._callers[min(self._callers, key=lambda c: self._callers[c][0])]
            self._callers[caller] = (now, 0)
            return quiet + 1

    def of(self, who: str | None) -> RefusalLog | _CallerView:
        """The log as seen by the calls of `who` (a caller's node, `poll_slots.caller_key`;
        None: a caller not told apart): its refusals are counted under its own key, not
        its host's."""
        return self if who is None else _CallerView(self, who)


class _CallerView:
    """`RefusalLog.refused` for one known caller: keyed by the caller, whatever host is given."""

    def __init__(self, log: RefusalLog, who: str):
        self._log, self._who = log, who

    def refused(self, host: str, now: float) -> int:
        return self._log.refused(self._who, now)


class RateLimitedLog:
    """A logger's warnings, at most one per kind every `interval_s` (by `RefusalLog`); the
    next line of a kind says how many were left out meanwhile.

    Args:
        logger: where the lines go.
        interval_s: the least time between two lines of one kind.
        clock: returns seconds (tests step it by hand).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = PERIOD_S,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self.kinds = RefusalLog(period_s=interval_s, max_callers=MAX_KINDS)

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log `message % args` unless a line of `kind` was written within `interval_s`
        (then count it); whether it was written."""
        count = self.kinds.refused(kind, self._clock())
        if not count:
            return False
        if count > 1:
            message += f" (and {count - 1} more like it in the last {self.interval_s:.0f}s)"
        self.logger.warning(message, *args)
        return True
