"""Fault injection at exact points, for tests and drills: `--inject kill:worker=1:step=30`.

Each process builds a `FaultInjector` from the run's faults, its role (worker, server,
rank or coordinator), its index and its start attempt; the injector keeps the faults meant
for it and fires them where the process calls it:

- `at_step(step)`: after each training step (a server: after each version; the
  coordinator: with the highest step any node has reported, from whichever thread
  answered the heartbeat). Fires kill (SIGKILL: no
  cleanup, no atexit, exactly as a machine loss looks to everyone else), stop (SIGSTOP,
  then SIGCONT from a detached helper once the duration is over: a hang) and slow (sleeps
  factor - 1 times the step's own duration: a straggler).
- `at_evaluation()`: inside each evaluation. Fires slow-eval.
- `drops_reply(step)`: before each gradient push. True when the push's reply is to be
  lost; the client then sends it and raises a transient error, so the retry meets the
  server's deduplication. It also arms delay-rpc: the push's reply comes back late.

The faults that reach code the process does not build itself (partition, slow-link and
delay-rpc on every gRPC channel and server; store-error and crash-checkpoint on every
checkpoint write) fire through `core.failpoints`; a process whose run has network faults
arms its channels for them at its start (`arm_fault_points`).

The grammar, the fault plan files and `Fault` itself live in `fault_spec` and are
re-exported here.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

from disttrain.core import failpoints
from disttrain.core.fault_spec import (
    ROLES,
    Fault,
    format_fault,
    load_fault_plan,
    parse_fault,
)

__all__ = ["ROLES", "Fault", "FaultInjector", "arm_fault_points", "format_fault", "load_fault_plan",
           "parse_fault"]

NETWORK_ACTIONS = ("partition", "slow-link", "delay-rpc")
# The calls that carry a worker's push: a delayed reply is the reply to one of them.
PUSH_METHODS = ("/PushGradients", "/SendGradients", "/Step")


def arm_fault_points(faults: Iterable[Fault]) -> None:
    """Call at a process's start, before it opens any channel: with a network fault in
    the run (for whichever process), its channels and servers carry the fault points."""
    if any(f.action in NETWORK_ACTIONS for f in faults):
        failpoints.arm_network()

logger = logging.getLogger(__name__)

# Run by a detached helper: a stopped process cannot wake itself. The helper first waits
# until the target is really stopped (Linux /proc; elsewhere it goes straight on), so the
# hang lasts its full duration however late the helper starts.
CONTINUE_SCRIPT = """
import os, signal, sys, time
pid, seconds = int(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                break
    except OSError:
        break
    time.sleep(0.001)
time.sleep(seconds)
try:
    os.kill(pid, signal.SIGCONT)
except ProcessLookupError:
    pass
"""


class FaultInjector:
    """The faults meant for one process, fired where the process calls the injector.

    Args:
        faults: every fault of the run; those for other processes or attempts are dropped.
        role: worker, server, rank or coordinator (the baseline's one process is worker 0).
        index: the process's worker, shard or rank number (the coordinator: 0).
        attempt: how many times this process has been restarted (0 = the first start).
        clock: the time source measuring steps for `slow` (tests pass a fake one).

    Raises:
        ValueError: an unknown role.
    """

    def __init__(self, faults: Iterable[Fault], role: str, index: int = 0, attempt: int = 0, *,
                 clock: Callable[[], float] = time.perf_counter):
        if role not in ROLES:
            raise ValueError(f"fault injector: unknown role {role!r}; use one of {', '.join(ROLES)}")
        self._faults = [f for f in faults if f.applies_to(role, index, attempt)]
        self._fired: set[int] = set()
        self._fired_lock = threading.Lock()  # the coordinator calls at_step from several threads
        self._clock = clock
        self._last_step_end: float | None = None
        self._announced_factor = 1.0  # the slow factor the log last told of

    @property
    def faults(self) -> list[Fault]:
        """The faults meant for this process."""
        return list(self._faults)

    def at_step(self, step: int, train_time_s: float | None = None, waited_s: float = 0.0) -> None:
        """Call after each step: fires slow, then kill and stop once `step` reaches theirs.

        Args:
            step: the step just done (a server: its version; the coordinator: the highest
                step reported to it).
            train_time_s: the training clock's reading now. When given, `slow` measures
                each step on it (evaluation and checkpoint writes left out); otherwise on
                the wall clock between calls. The first step is only measured, not slowed.
            waited_s: how much of the step went to waiting for peers (its blocked
                communication): `slow` slows the rest, the process's own work, as a slower
                machine would, and not its waits.
        """
        entered = self._clock()
        now = entered if train_time_s is None else train_time_s
        self._straggle(step, now, waited_s)
        self._slow_link(step)
        for fault in self._due(step, ("partition", "store-error", "crash-checkpoint")):
            if fault.action == "partition":
                failpoints.partition(fault.seconds)
            elif fault.action == "store-error":
                failpoints.fail_checkpoints(fault.seconds)
            else:
                failpoints.die_in_next_checkpoint()
        for fault in self._due(step, ("kill", "stop", "term")):
            if fault.action == "kill":
                self._kill(step)
            elif fault.action == "term":
                logger.warning("injected fault: SIGTERM at step %d", step)
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting the process would
            else:
                self._stop(step, fault.seconds)
        # Time spent in here (slowed, stopped) belongs to this step, not the next one.
        self._last_step_end = now + (self._clock() - entered)

    def at_evaluation(self) -> None:
        """Call inside each evaluation: slow-eval sleeps its seconds, every time."""
        for fault in self._faults:
            if fault.action == "slow-eval":
                logger.warning("injected fault: evaluation slowed by %gs", fault.seconds)
                time.sleep(fault.seconds)

    def drops_reply(self, step: int) -> bool:
        """Call before sending the gradient push of `step`: True (once per drop-rpc fault)
        when the reply to this push is to be lost."""
        for fault in self._due(step, ("delay-rpc",)):
            failpoints.delay_next_reply(PUSH_METHODS, fault.seconds)
        dropped = bool(self._due(step, ("drop-rpc",)))
        if dropped:
            logger.warning("injected fault: the reply to the push of step %d is lost", step)
        return dropped

    def _due(self, step: int, actions: tuple[str, ...]) -> list[Fault]:
        """The faults of `actions` that `step` reaches for the first time; marked fired."""
        due = []
        with self._fired_lock:
            for number, fault in enumerate(self._faults):
                if fault.action in actions and number not in self._fired and step >= fault.step:
                    self._fired.add(number)
                    due.append(fault)
        return due

    def straggle_for(self, seconds: float) -> float:
        """As a `slow` fault slows a step of `seconds`: sleep the extra time; return it
        (0 without one). For work timed outside the loop, a warm-up measuring speed."""
        factor = max((f.factor for f in self._faults if f.slows(0)), default=1.0)
        extra = max(0.0, (factor - 1) * seconds)
        if extra:
            time.sleep(extra)
        return extra

    def _slow_link(self, step: int) -> None:
        latency_s = max((f.seconds for f in self._faults if f.slows(step, "slow-link")), default=0.0)
        if latency_s or failpoints.network.latency_s:
            failpoints.slow_link(latency_s)

    def _straggle(self, step: int, now: float, waited_s: float = 0.0) -> None:
        factor = max((f.factor for f in self._faults if f.slows(step)), default=1.0)
        if factor != self._announced_factor:
            if factor > 1:
                logger.warning("injected fault: from step %d every step's work takes %g times as long",
                               step, factor)
            else:
                logger.warning("injected fault: from step %d steps take their normal time again", step)
            self._announced_factor = factor
        if factor <= 1 or self._last_step_end is None:
            return
        time.sleep((factor - 1) * max(0.0, now - self._last_step_end - waited_s))

    def _kill(self, step: int) -> None:
        logger.warning("injected fault: kill at step %d", step)
        _flush_logs()
        os.kill(os.getpid(), signal.SIGKILL)

    def _stop(self, step: int, seconds: float) -> None:
        logger.warning("injected fault: stopped at step %d for %gs", step, seconds)
        _flush_logs()
        helper = subprocess.Popen([sys.executable, "-c", CONTINUE_SCRIPT, str(os.getpid()), repr(seconds)],
                                  start_new_session=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.kill(os.getpid(), signal.SIGSTOP)
        logger.warning("injected fault: continued after the stop at step %d", step)
        try:
            helper.wait(timeout=5.0)  # it exits right after sending SIGCONT; reap it
        except subprocess.TimeoutExpired:
            logger.debug("the continue helper %d has not exited yet", helper.pid)


def _flush_logs() -> None:
    """What was logged so far reaches its files before the process dies or stops."""
    for handler in logging.getLogger().handlers:
        handler.flush()
