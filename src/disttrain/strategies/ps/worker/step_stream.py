"""The worker's end of a Step stream: one call kept open for the run, one push out and
its reply back per step, each reply awaited at most a deadline.

A stream has no per-message deadline in gRPC, so a watchdog thread cancels the call when
a reply is late (a server that hangs instead of failing). Any failure closes the call;
the next exchange opens a new one, and the push it resends is answered DUPLICATE by a
server that took it already, never applied twice.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc


class StreamBroken(ConnectionError):
    """The stream ended or its reply came too late; transient: a new stream is opened."""


class _Watchdog:
    """Cancels the armed call once its deadline passes. Arming is cheap: the thread is
    woken only when it sleeps without a deadline (after one went by unarmed), since every
    new deadline lies after the one it already waits for."""

    def __init__(self):
        self._cond = threading.Condition()
        self._call: Any = None
        self._deadline: float | None = None
        self._idle = True
        self._closed = False
        self.fired = False
        threading.Thread(target=self._run, name="ps-step-watchdog", daemon=True).start()

    def arm(self, call: Any, timeout_s: float) -> None:
        with self._cond:
            self._call, self._deadline, self.fired = call, time.monotonic() + timeout_s, False
            if self._idle:
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._call = self._deadline = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._idle = True
                    self._cond.wait()
                    continue
                self._idle = False
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self.fired, self._deadline = True, None
                self._call.cancel()


class StepStream:
    """Exchanges on one Step call, opened by `open_call(requests)` when first needed."""

    def __init__(self, open_call: Callable[[Iterator[bytes]], Any]):
        self._open = open_call
        self._requests: queue.SimpleQueue | None = None
        self._call: Any = None
        self._watchdog = _Watchdog()

    def exchange(self, message: bytes, timeout_s: float) -> Any:
        """Send one push; its reply (as the call's deserializer makes it).

        Raises:
            grpc.RpcError: the server ended the stream with a status.
            StreamBroken: no reply within `timeout_s`, or the stream ended without one.
        """
        if self._call is None:
            self._requests = queue.SimpleQueue()
            self._call = self._open(iter(self._requests.get, None))
        self._requests.put(message)
        self._watchdog.arm(self._call, timeout_s)
        try:
            return next(self._call)
        except StopIteration as e:
            self.close()
            raise StreamBroken("the server ended the step stream") from e
        except grpc.RpcError as e:
            self.close()
            if self._watchdog.fired:
                raise StreamBroken(f"no reply to the step within {timeout_s:g}s") from e
            raise
        except BaseException:
            self.close()
            raise
        finally:
            self._watchdog.disarm()

    def close(self) -> None:
        """End the call (the next exchange opens another)."""
        if self._call is not None:
            self._requests.put(None)
            self._call.cancel()
            self._call = self._requests = None

    def shutdown(self) -> None:
        self.close()
        self._watchdog.close()
