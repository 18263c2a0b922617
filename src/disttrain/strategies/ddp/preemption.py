"""Preemption of a DDP rank group: SIGTERM (a scheduler reclaiming a machine) stops every
rank at one step, with that step's checkpoint, within the grace period.

The signal reaches the ranks at different steps, or only one of them (the launcher
forwards its own SIGTERM to every rank; a machine of several nodes may be reclaimed
alone). Each rank's handler only raises its own flag (`RankSignal`); the ranks agree at
the training loop's stop points (every step's end), where the loop asks `StopAgreement`,
whose answer is every rank's flag reduced by MAX: all ranks get the same answer at the
same step, so they stop together, rank 0 writes the checkpoint of that step as the
periodic one would, and every rank exits with `Preempted` (exit code 143), which the
launcher reads as a preemption rather than a failure to restart.

A blocking all-reduce at every step's end costs a small step a measurable part of its
time (benchmarks/ddp_stop_agreement.py), so the agreement runs in rounds: each round's
all-reduce is waited for at the next round, the steps between running meanwhile, and
rounds are about `ROUND_INTERVAL_S` of training apart (every step when a step is longer),
the spacing agreed in the rounds themselves. The ranks stop within two spacings of the
first flag raised, well inside any grace period.

A second SIGTERM, or `system.preemption_grace_s` passing before the rank has stopped
with its checkpoint, ends the rank at once (exit code 143, with an error file saying no
checkpoint was written for the stop): the grace clock runs on its own thread, so a rank
blocked in a collective whose peer is gone still ends in time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import DisttrainError, Preempted
from disttrain.strategies.ddp.error_file import AtomicErrorHandler

logger = logging.getLogger(__name__)

GRACE_KEY = "system.preemption_grace_s"
_PREFIX = f"{Preempted.__name__}: "  # how the error file names the rank's error
_STOPPED = re.compile(r"stopped at step (\d+) with its checkpoint")
NOT_SAVED = "no checkpoint was written for the stop"
ROUND_INTERVAL_S = 0.05  # training time between two rounds of the stop agreement
MAX_SPACING = 100  # stop points between two rounds at most


def stopped_line(step: int) -> str:
    """A rank's message when the group stopped at `step` with its checkpoint."""
    return (f"stopped at step {step} with its checkpoint ({ckpt.checkpoint_name(step)}), as every rank "
            "agreed after a SIGTERM")


def stopped_step(message: str) -> int | None:
    """The step of a `stopped_line` (None: the message is not one)."""
    match = _STOPPED.search(message)
    return None if match is None else int(match.group(1))


class RankSignal:
    """This rank's SIGTERM: the first raises `requested` and starts the grace clock; a
    second, or the grace passing before `stopped`, ends the process (`expire`).

    Args:
        rank: this rank, for the lines it writes.
        grace_s: `system.preemption_grace_s`.
        expire: ends the process with one line (default: error file, then exit 143).
    """

    def __init__(self, rank: int, grace_s: float, expire: Callable[[str], None] | None = None):
        self.rank, self.grace_s = rank, grace_s
        self.requested = threading.Event()
        self._expire = expire or self._exit
        self._timer: threading.Timer | None = None
        self._done = False

    def handle(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        """The SIGTERM handler (runs on the main thread, between two bytecodes)."""
        if self._done:
            return  # stopped with a checkpoint already: the agent's own teardown signal
        if self.requested.is_set():
            self._expire(f"rank {self.rank}: a second SIGTERM came before the ranks stopped; "
                         f"{NOT_SAVED}")
            return
        self.requested.set()
        logger.warning("SIGTERM: stopping at a step every rank agrees on, with its checkpoint, "
                       "within %gs (%s)", self.grace_s, GRACE_KEY)
        self._timer = threading.Timer(self.grace_s, self._expire, args=(
            f"rank {self.rank}: the ranks did not stop with a checkpoint within {self.grace_s:g}s of "
            f"the SIGTERM ({GRACE_KEY}); {NOT_SAVED}",))
        self._timer.daemon = True
        self._timer.start()

    def stopped(self) -> None:
        """The group stopped with its checkpoint: the grace clock stops, and a later SIGTERM
        (the agent stopping the ranks still exiting) changes nothing."""
        self._done = True
        if self._timer is not None:
            self._timer.cancel()

    def _exit(self, line: str) -> None:
        logger.error("%s", line)
        AtomicErrorHandler().record_exception(Preempted(line))
        logging.shutdown()
        os._exit(Preempted.exit_code)


def proposed_spacing(elapsed_s: float, num_points: int, interval_s: float) -> int:
    """Stop points between two rounds that make about `interval_s` of training, from the
    `elapsed_s` the last `num_points` took: at least 1, at most `MAX_SPACING`."""
    if elapsed_s <= 0:
        return MAX_SPACING
    return int(min(MAX_SPACING, max(1.0, interval_s * num_points / elapsed_s)))


class StopAgreement:
    """The loop's `stop_requested` for a rank group, in rounds: a round all-reduces every
    rank's flag (MAX) without blocking, and the next round's point waits for it; the
    answer is whether any rank's flag was up when the previous round started.

    A round every stop point would cost every step a collective; so rounds are spaced by
    about `interval_s` of training (every point when a step takes longer). Each round
    carries every rank's proposal for the spacing, from its own time per point, and the
    ranks take the smallest (MAX of its negation, in the same all-reduce): they all know
    the spacing at the same point, so the rounds stay at the same points on every rank. A
    flag raised between two rounds is answered within two spacings.

    A collective: the loop asks it at the same points on every rank
    (`training.loop.StopRequest`). Call `settle` once after the loop ends normally: it
    waits for the round still in flight.
    """

    def __init__(self, flag: threading.Event, device: torch.device, interval_s: float = ROUND_INTERVAL_S,
                 clock: Callable[[], float] = time.perf_counter):
        self.flag, self.device, self.interval_s, self.clock = flag, device, interval_s, clock
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._points_left = 0  # points to pass before the next round
        self._spacing = 1  # points between two rounds, as the ranks last agreed
        self._round_started = clock()
        self.num_rounds = 0

    def is_set(self) -> bool:
        if self._points_left > 0:
            self._points_left -= 1
            return False
        if self._settle():
            return True
        now = self.clock()
        proposal = proposed_spacing(now - self._round_started, self._spacing, self.interval_s)
        self._round_started = now
        flag = 1 if self.flag.is_set() else 0
        tensor = torch.tensor([flag, -proposal], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        assert work is not None
        self._pending = (work, tensor)
        self.num_rounds += 1
        self._points_left = self._spacing - 1
        return False

    def settle(self) -> None:
        """Wait for the round in flight (its answer no longer matters)."""
        self._settle()

    def _settle(self) -> bool:
        """Wait for the round in flight; take its spacing; whether it says stop."""
        if self._pending is None:
            return False
        work, tensor = self._pending
        self._pending = None
        work.wait()
        stop, negated = tensor.tolist()
        self._spacing = -int(negated)
        return bool(stop)


class SyncStopAgreement(StopAgreement):
    """The plain agreement, beside the one in rounds: a blocking MAX all-reduce of every
    rank's flag at each stop point, so the ranks stop at the step a flag was first raised
    (kept for the benchmark that measures what the rounds save)."""

    def is_set(self) -> bool:
        tensor = torch.tensor([1 if self.flag.is_set() else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())


@dataclass(frozen=True)
class GroupStop:
    """How a preempted rank group ended, as the launcher reports it.

    Attributes:
        step: the step the ranks agreed on, whose checkpoint was written (None: none was).
        reason: a rank's line saying why no checkpoint was written ("" when one was).
    """

    step: int | None
    reason: str = ""

    def line(self, checkpoint_dir: str) -> str:
        """The launcher's one line (`checkpoint_dir`: where the newest checkpoint is looked for)."""
        if self.step is not None:
            return (f"preempted at step {self.step}: every rank stopped there with its checkpoint "
                    f"({ckpt.checkpoint_name(self.step)}); run the same command with --resume to go on")
        try:
            latest = ckpt.latest_checkpoint(checkpoint_dir)
        except (DisttrainError, OSError, ValueError):
            latest = None
        where = ("there is no checkpoint yet: run the same command to start over" if latest is None
                 else f"the newest checkpoint is {latest} (step {ckpt.checkpoint_step(latest)}): run the "
                      "same command with --resume to go on from it")
        return f"preempted: {self.reason}; {where}"


def group_stop(messages: Iterable[Any]) -> GroupStop | None:
    """How the group stopped, from its ranks' error messages (the agent's failure messages
    or error files; a mapping's `message`): None when no rank was preempted. One rank that
    stopped with the agreed checkpoint is enough: it stopped only once every rank was past
    the checkpoint's write."""
    preempted = [text[len(_PREFIX):] for text in map(_message_text, messages) if text.startswith(_PREFIX)]
    if not preempted:
        return None
    steps = [step for step in map(stopped_step, preempted) if step is not None]
    if steps:
        return GroupStop(max(steps))
    return GroupStop(None, preempted[0])


def error_file_messages(folder: Path) -> list[Any]:
    """The messages of the error files the ranks left under the agent's `folder` (those
    that cannot be read are left out: a rank killed before writing leaves none)."""
    messages = []
    for path in sorted(folder.rglob("error.json")):
        try:
            messages.append(json.loads(path.read_text()).get("message", ""))
        except (OSError, ValueError, AttributeError):
            continue
    return messages


def _message_text(message: Any) -> str:
    if isinstance(message, Mapping):
        message = message.get("message", "")
    return str(message or "").strip()
