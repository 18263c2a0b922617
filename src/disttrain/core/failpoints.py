"""Fault points: where an injected fault reaches code that the process's entry point never
builds itself (every gRPC channel and server of the process, every checkpoint write).

A process arms its faults once, at its start (`FaultInjector` does, for the faults meant
for it); from then on the code at each point asks this module what to do:

- the network (`NetworkFaults`): a **partition** cuts the process off for a while, both
  ways: its own calls fail UNAVAILABLE, and the calls it serves are refused UNAVAILABLE,
  on streams already open too, as when a switch port goes dark or a proxy between the
  process and the others closes every connection and refuses new ones. A **slow link**
  adds latency to each of its calls. A **delayed reply**: the reply to its next call of a
  method comes back late (past the call's deadline it is lost: the caller sees
  DEADLINE_EXCEEDED, and retries a call the server already took).
- checkpoints (`CheckpointFaults`): writes fail with ENOSPC for a while (a full disk or
  an unwritable store), or the process dies in the middle of its next write, with the
  data partly written and nothing yet made complete (a crash during a checkpoint).

Why a process-wide registry, which the house style otherwise avoids: a channel is opened
deep inside a strategy (a worker's shard clients, the coordinator client of any process),
a checkpoint written by whichever part owns that state; threading an injector through
every constructor would put test plumbing into every signature. etcd's gofail and
FoundationDB's BUGGIFY make the same choice. Nothing is armed unless a fault names the
process, and a point then costs one attribute read; channels and servers carry the
network points (`core.rpc_faults`) only in a process armed for a network fault, which
is decided at its start, before it opens any.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

@dataclass
class NetworkFaults:
    """The network faults in force in this process (monotonic deadlines)."""

    armed: bool = False  # a network fault is meant for this process: wrap its channels and servers
    cut_until: float = 0.0
    latency_s: float = 0.0
    delayed: list[tuple[tuple[str, ...], float]] = field(default_factory=list)  # (method suffixes, s)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cut(self, now: float | None = None) -> bool:
        """Whether the process is cut off now."""
        return (time.monotonic() if now is None else now) < self.cut_until

    def take_delay(self, method: str) -> float:
        """Seconds to hold the next reply of a call of `method` (0: none); used up once taken."""
        if not self.delayed:
            return 0.0
        with self.lock:
            for number, (suffixes, seconds) in enumerate(self.delayed):
                if method.endswith(suffixes):
                    del self.delayed[number]
                    return seconds
        return 0.0


@dataclass
class CheckpointFaults:
    """The checkpoint faults in force in this process."""

    fail_until: float = 0.0
    die_in_next_write: bool = False


network = NetworkFaults()
checkpoints = CheckpointFaults()


# -- arming (FaultInjector) ----------------------------------------------------------------

def arm_network() -> None:
    """A network fault is meant for this process: channels and servers made from now on
    carry the fault points. Call at the process's start."""
    network.armed = True


def partition(seconds: float) -> None:
    """Cut the process off for `seconds` from now."""
    logger.warning("injected fault: partitioned from every other process for %gs", seconds)
    network.cut_until = max(network.cut_until, time.monotonic() + seconds)


def slow_link(latency_s: float) -> None:
    """Every call of this process, in and out, takes `latency_s` longer (0: normal again)."""
    if latency_s != network.latency_s:
        logger.warning("injected fault: the link of this process adds %gs to each call", latency_s)
    network.latency_s = latency_s


def delay_next_reply(method_suffixes: tuple[str, ...], seconds: float) -> None:
    """The next reply this process receives to a call of a method ending in one of
    `method_suffixes` (on a stream: its next message) comes back `seconds` late."""
    logger.warning("injected fault: the next reply to %s comes back %gs late", "/".join(method_suffixes),
                   seconds)
    with network.lock:
        network.delayed.append((method_suffixes, seconds))


def fail_checkpoints(seconds: float) -> None:
    """Checkpoint writes fail with ENOSPC for `seconds` from now."""
    logger.warning("injected fault: checkpoint writes fail (no space left) for %gs", seconds)
    checkpoints.fail_until = max(checkpoints.fail_until, time.monotonic() + seconds)


def die_in_next_checkpoint() -> None:
    """The process is killed in the middle of its next checkpoint write."""
    logger.warning("injected fault: the process dies during its next checkpoint write")
    checkpoints.die_in_next_write = True


# -- the points ------------------------------------------------------------------------------

def checkpoint_write(location: Any) -> None:
    """Call before a checkpoint's bytes are written.

    Raises:
        OSError: ENOSPC, while a `fail_checkpoints` fault is in force.
    """
    if time.monotonic() < checkpoints.fail_until:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected fault)", str(location))


def checkpoint_written_partly() -> None:
    """Call once part of a checkpoint is written and before it is made complete: SIGKILL
    when a `die_in_next_checkpoint` fault is armed."""
    if checkpoints.die_in_next_write:
        logger.warning("injected fault: killed in the middle of a checkpoint write")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
