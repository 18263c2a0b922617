"""Server-side deadlines: a call that outlives the time its server gives it is cancelled.

A client sets its own deadline, or none; a server handler reading a client stream waits
on each next message for as long as the client likes, holding a handler thread. So a
server bounds such calls itself: `Deadlines.limit(context, seconds)` around the part of
a handler that waits on the client. One thread serves every call (a timer thread per
call would cost more than a small push); it cancels the call when its time is up, which
ends the handler's wait with an error and the client's call with CANCELLED.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class Deadlines:
    """Cancels calls past their server-side deadline (thread-safe; one daemon thread,
    started on first use)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._changed = threading.Condition()
        self._heap: list[list] = []  # [deadline, sequence, context or None once the call ended]
        self._sequence = itertools.count()
        self._thread: threading.Thread | None = None
        self.num_cancelled = 0

    @contextmanager
    def limit(self, context: grpc.RpcContext, seconds: float) -> Iterator[None]:
        """Cancel the call of `context` if the block still runs after `seconds`."""
        entry = [self._clock() + seconds, next(self._sequence), context]
        with self._changed:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="call-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:
                self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                entry[2] = None

    def _run(self) -> None:
        with self._changed:
            while True:
                while self._heap and self._heap[0][2] is None:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._changed.wait()
                    continue
                delay = self._heap[0][0] - self._clock()
                if delay > 0:
                    self._changed.wait(delay)
                    continue
                context = heapq.heappop(self._heap)[2]
                self.num_cancelled += 1
                context.cancel()
