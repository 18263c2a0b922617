"""Start a local cluster of processes, stream their logs, and never leave one behind.

Each child is described by a `ProcessSpec` (`core.process_spec`) and runs in its own
session (so a Ctrl-C reaches only the launcher, which then stops the children in order),
with its stdout and stderr in `<log_dir>/<name>.log`. Children report to the launcher
with event lines on stdout (`emit_event`): the address a server bound, progress. Two
kinds the cluster keeps on each child for its supervisor: `progress` with a `point` (the
furthest step, or a shard's version, the process reached: `ProgressReport`) and `error`
(the error it fails with: `report_error`). A child calls `bind_to_parent()` first thing:
on Linux the kernel then kills it when the launcher dies, however the launcher dies
(SIGKILL included); elsewhere a watchdog thread does the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.core import forking
from disttrain.core.errors import DistributedError, DisttrainError
from disttrain.core.forking import ForkedProcess, die_with_parent
from disttrain.core.logs import open_log
from disttrain.core.process_spec import ProcessSpec, command_line

logger = logging.getLogger(__name__)

EVENT_PREFIX = "@disttrain-event "
PARENT_ENV = "DISTTRAIN_PARENT_PID"
PROGRESS_EVENT = "progress"  # with `point`: how far the process got (more fields for a display)
ERROR_EVENT = "error"  # the error the process fails with: exception, message, recoverable
_QUIET_EVENTS = {PROGRESS_EVENT, ERROR_EVENT}  # out of the log files: frequent, or told there already
# How long a child may take to report the address it listens on (importing torch, loading
# a model and data on a loaded machine can take tens of seconds).
STARTUP_TIMEOUT_S = 120.0


_EMIT_LOCK = threading.Lock()


def emit_event(kind: str, **fields: Any) -> None:
    """Tell the launcher something (one JSON line on stdout); a no-op when not launched.

    Callable from any thread: the line and its newline go out in one write under a lock.
    (`print` writes them apart, so two threads' events could share one line, which the
    launcher cannot read: a worker's preemption was lost that way beside a progress report.)
    """
    if PARENT_ENV in os.environ:
        line = EVENT_PREFIX + json.dumps({"event": kind, **fields}) + "\n"
        with _EMIT_LOCK:
            sys.stdout.write(line)
            sys.stdout.flush()


class ProgressReport:
    """Tells the launcher the furthest point this process reached (a step, a shard's
    version), once for each new furthest point: what its supervisor's restart budget
    measures progress by (`coordinator.budget`). Callable from any thread."""

    def __init__(self) -> None:
        self.furthest: int | None = None
        self._lock = threading.Lock()

    def __call__(self, point: int) -> None:
        with self._lock:
            if self.furthest is not None and point <= self.furthest:
                return
            self.furthest = point
        emit_event(PROGRESS_EVENT, point=int(point))


def report_error(error: BaseException) -> None:
    """Tell the launcher the error this process is about to fail with: its class, its first
    line, and whether it says a restart may mend it (`DisttrainError.recoverable`; None for
    an exception the code did not expect). Call in the entry point's handler, before exiting."""
    recoverable = error.recoverable if isinstance(error, DisttrainError) else None
    text = str(error).strip()
    emit_event(ERROR_EVENT, exception=type(error).__name__, recoverable=recoverable,
               message=(text.splitlines()[0] if text else type(error).__name__)[:1000])


def bind_to_parent() -> None:
    """Die with the launcher that started this process (no-op when not launched)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    parent_pid = int(parent)
    bound = die_with_parent()
    if os.getppid() != parent_pid:  # the launcher died before the line above took effect
        os._exit(1)
    if not bound:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Child:
    """One process of the cluster. `furthest` and `error` hold what it reported (its
    furthest `progress` point, its `error` event's fields); both are final once its exit
    event is out."""

    name: str
    process: subprocess.Popen | ForkedProcess
    log_path: Path
    exit_code: int | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    furthest: int | None = None
    error: dict[str, Any] | None = None

    def heard(self, kind: str, fields: dict[str, Any]) -> None:
        """Keep what an event of this child tells its supervisor."""
        if kind == PROGRESS_EVENT and isinstance(fields.get("point"), int):
            self.furthest = fields["point"] if self.furthest is None else max(self.furthest, fields["point"])
        elif kind == ERROR_EVENT:
            self.error = fields

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


@dataclass
class Event:
    """What the launcher hears: a child's event line ("kind" from the child), or its exit."""

    child: str
    kind: str
    fields: dict[str, Any]


class Cluster:
    """A group of child processes. Use as a context manager: leaving it stops them all.

    Args:
        log_dir: where each child's `<name>.log` goes.
        env: variables set in every child's environment beside this process's own (how a
            launcher hands its children a secret, which a command line would show to
            every user); a restarted child gets them again.
        env_of: variables of one child, from its spec (on top of `env`): e.g. a token of
            its own.
    """

    def __init__(self, log_dir: str | Path, env: dict[str, str] | None = None,
                 env_of: Callable[[ProcessSpec], dict[str, str]] | None = None):
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.env_of = env_of
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, Child] = {}
        self.events: queue.Queue[Event] = queue.Queue()
        self.addresses: dict[str, str] = {}  # child -> the address it reported it listens on
        self._held: deque[Event] = deque()  # events that came while waiting for an address

    def spawn(self, name: str, spec: ProcessSpec, env: dict[str, str] | None = None) -> Child:
        """Start the process `spec` describes as child `name` (call from the main thread:
        the kernel ties a child's death signal to the thread that forked it)."""
        log_path = self.log_dir / f"{name}.log"
        log_file = open_log(log_path)
        own = self.env_of(spec) if self.env_of is not None else {}
        child_env = {**os.environ, **self.env, **own, **(env or {}), PARENT_ENV: str(os.getpid()),
                     "PYTHONUNBUFFERED": "1"}
        args = command_line(spec)
        try:  # forked where it can be: torch imported once, not once a child (core.forking)
            process = forking.start([sys.executable, *args], child_env, None, log_file.fileno(),
                                    parent_env=PARENT_ENV)
        finally:
            log_file.close()
        child = Child(name, process, log_path)
        child.threads = [threading.Thread(target=self._read, args=(child,), daemon=True),
                         threading.Thread(target=self._wait, args=(child,), daemon=True)]
        for thread in child.threads:
            thread.start()
        self.children[name] = child
        logger.debug("started %s (pid %d): %s", name, process.pid, " ".join(args))
        return child

    def _read(self, child: Child) -> None:
        with open_log(child.log_path) as log:
            for raw in child.process.stdout:
                line = raw.decode(errors="replace")
                if line.startswith(EVENT_PREFIX):
                    try:
                        fields = json.loads(line[len(EVENT_PREFIX):])
                    except ValueError:
                        fields = None
                    if isinstance(fields, dict):
                        kind = str(fields.pop("event", ""))
                        child.heard(kind, fields)
                        self.events.put(Event(child.name, kind, fields))
                        if kind in _QUIET_EVENTS:
                            continue
                log.write(raw)

    def _wait(self, child: Child) -> None:
        code = child.process.wait()
        for thread in child.threads[:1]:
            thread.join(timeout=5.0)  # deliver its last events before its exit
        self.events.put(Event(child.name, "exit", {"code": code}))

    def next_event(self, timeout_s: float | None) -> Event | None:
        """The next event (one held back by `wait_listening` first), or None after `timeout_s`."""
        if self._held:
            return self._held.popleft()
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if event.kind == "listening":
            self.addresses[event.child] = str(event.fields["address"])
        return event

    def wait_listening(self, name: str, timeout_s: float = STARTUP_TIMEOUT_S,
                       restarted: Callable[[str, int], bool] | None = None) -> str:
        """The address child `name` reports it listens on (a restarted child binds the
        same). Other events stay queued for `next_event`, in order.

        Args:
            restarted: called with (child, exit code) when `name` exits before it
                listens; True when it was started again (then the wait goes on).
        Raises:
            DistributedError: `name` exited (and was not restarted), or did not report
                within `timeout_s`; its log is named.
        """
        deadline = time.monotonic() + timeout_s
        while name not in self.addresses:
            # An exit of `name` held back while waiting for another child comes first.
            held = next((e for e in self._held if e.child == name and e.kind == "exit"), None)
            if held is not None:
                self._held.remove(held)
                event = held
            else:
                try:
                    event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise DistributedError(f"{name} did not start within {timeout_s:.0f}s; see "
                                           f"{self.log_dir}/{name}.log") from None
            if event.kind == "listening":
                self.addresses[event.child] = str(event.fields["address"])
            if event.child == name and event.kind == "exit":
                code = int(event.fields["code"])
                if restarted is None or not restarted(name, code):
                    raise DistributedError(f"{name} exited with code {code} before it listened; see "
                                           f"{self.log_dir}/{name}.log")
            elif event.kind != "listening":
                self._held.append(event)
        return self.addresses[name]

    def alive(self) -> list[Child]:
        return [c for c in self.children.values() if c.process.poll() is None]

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace_s`."""
        for child in self.alive():
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children.values():
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs; killing it", child.name, grace_s)
                _signal_group(child.process, signal.SIGKILL)
                child.process.wait()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen | ForkedProcess, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def sigterm_handled_by(handler: Callable[[int, Any], None] | None) -> Iterator[None]:
    """Within the block, SIGTERM (a scheduler's preemption) calls `handler` instead of
    ending the process: each strategy's handler asks its training loop to stop at a step.
    Only where signals can be handled (the main thread); elsewhere, or with no handler,
    SIGTERM keeps its default."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def raise_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in the main thread, so `with Cluster` cleans up."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def thread_count(num_threads: int, processes_per_machine: int = 1) -> int:
    """The intra-op threads of each of `processes_per_machine` processes on this machine.

    Args:
        num_threads: explicit count, or 0 for the machine's cores divided among processes.
    """
    if num_threads > 0:
        return num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(processes_per_machine, 1))
