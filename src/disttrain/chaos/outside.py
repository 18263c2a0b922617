"""Signals sent to a run from outside, as the world sends them: SIGKILLs and hangs by the
clock (`TimedFaults`), preemptions (`PreemptionSender`: SIGTERM to the launcher or to
one member once the run has reached a step, as a scheduler reclaiming a machine does), and
an elastic run's changes of size (`ResizeSender`: SIGUSR1 to the launcher, SIGTERM to one
worker); each a `Sender`, a thread started with the run and stopped when it ends (a live
DDP group's arrivals, leaves and deaths: `chaos.arrivals`).

Every process of a run carries a tag in its environment (`TAG_ENV`, inherited by every
child and grandchild), so a signal goes only to a process of this launch, whatever a
registry left by an earlier launch of the same run says.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from disttrain.chaos.elastic import GROW, Resize
from disttrain.chaos.scenarios import Scenario
from disttrain.chaos.schedule import LAUNCHER, Preemption, TimedFault
from disttrain.coordinator.registry import RegistryError, read_status

TAG_ENV = "DISTTRAIN_CHAOS_RUN"
POLL_S = 0.1


def tagged_pids(tag: str) -> list[int]:
    """The live processes whose environment carries `tag` (zombies aside)."""
    needle = f"{TAG_ENV}={tag}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() + b"\0" \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


class Sender:
    """A thread that sends faults to a run from outside: `start` it with the run, `stop` it
    once the run has ended (it ends at once, or when its `_run` finds nothing more to send).
    Subclasses say whether they have anything to send (`active`) and send it in `_run`,
    waiting with `self._done.wait(seconds)`, which is true once stopped."""

    def __init__(self, name: str, active: bool):
        self._active = active
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        if self._active:
            self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class TimedFaults(Sender):
    """Sends a schedule's timed faults to the processes of a run from a thread: the clock
    starts once every worker (rank) of the run is alive in the registry."""

    def __init__(self, scenario: Scenario, faults: tuple[TimedFault, ...], log_dir: Path, tag: str):
        super().__init__("chaos-timed-faults", bool(faults))
        self.scenario, self.faults, self.log_dir, self.tag = scenario, faults, log_dir, tag
        self.sent: list[str] = []

    def _nodes(self) -> list[dict[str, Any]]:
        try:
            return read_status(self.log_dir / "cluster.db").nodes
        except RegistryError:
            return []  # not there yet, or busy: the next poll

    def _run(self) -> None:
        trainers = {"worker", "rank"}
        started = None
        while started is None and not self._done.wait(POLL_S):
            nodes = [n for n in self._nodes() if n["role"] in trainers]
            if len(nodes) >= self.scenario.workers and all(n["state"] == "alive" for n in nodes):
                started = time.monotonic()
        for fault in self.faults:
            if self._done.wait(max(0.0, started + fault.at_s - time.monotonic()) if started else 0.0) \
                    or started is None:
                return
            self._send(fault)

    def _send(self, fault: TimedFault) -> None:
        node_id = f"{fault.role}{fault.index}"
        node = next((n for n in self._nodes() if n["node_id"] == node_id), None)
        pid = node["pid"] if node and node["state"] == "alive" else None
        if not pid or pid not in tagged_pids(self.tag):
            self.sent.append(f"{fault.describe()}: skipped, {node_id} not running")
            return
        try:
            os.kill(pid, signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            self.sent.append(f"{fault.describe()}: skipped, {node_id} ended")
            return
        self.sent.append(f"{fault.describe()}: sent to pid {pid}")
        if fault.action == "stop":
            threading.Timer(fault.seconds, lambda: _continue(pid)).start()


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


class PreemptionSender(Sender):
    """Sends one preemption to a launch from a thread: SIGTERM to the launcher (`pid`) or
    to its member, once a member of this launch (a process carrying its `tag`) has
    reported the preemption's step to the registry (a heartbeat late: the signal lands a
    few steps after it)."""

    def __init__(self, preemption: Preemption | None, launcher_pid: int, log_dir: Path, tag: str):
        super().__init__("chaos-preemption", preemption is not None)
        self.preemption, self.launcher_pid, self.log_dir, self.tag = preemption, launcher_pid, log_dir, tag
        self.sent: str | None = None  # what was sent, to which pid, at which step

    def _run(self) -> None:
        assert self.preemption is not None
        while not self._done.wait(POLL_S):
            members = self._members()
            reached = max((node["step"] or 0 for node in members.values()), default=-1)
            if reached < self.preemption.step:
                continue
            if self.preemption.target == LAUNCHER:
                pid = self.launcher_pid
            else:
                node = members.get(f"{self.preemption.target}{self.preemption.index}")
                if node is None:
                    continue  # between its restarts: the signal waits for it to be back
                pid = node["pid"]
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            target = self.preemption
            whom = "the launcher" if target.target == LAUNCHER else f"{target.target} {target.index}"
            self.sent = f"preempt at step {target.step}: SIGTERM to {whom} (pid {pid}) at step {reached}"
            return

    def _members(self) -> dict[str, dict[str, Any]]:
        return members(self.log_dir, self.tag)


def members(log_dir: Path, tag: str) -> dict[str, dict[str, Any]]:
    """The members (workers, ranks) of the launch tagged `tag` alive in its registry, by node id."""
    try:
        nodes = read_status(log_dir / "cluster.db").nodes
    except RegistryError:
        return {}  # not there yet, or busy: the next poll
    ours = set(tagged_pids(tag))
    return {n["node_id"]: n for n in nodes
            if n["role"] in ("worker", "rank") and n["state"] == "alive" and n["pid"] in ours}


class ResizeSender(Sender):
    """Sends an elastic run's changes of size one after the other from a thread: each once
    the run trains on the size before it (that many workers of this launch alive in the
    registry, none of them a process of the launch a change was sent to before: a change
    restarts every process) and one of them has reported the change's step, SIGUSR1 to
    the launcher (`launcher_pid`) for a grow, SIGTERM to the worker for a planned leave. A
    change sent earlier would land while the run restarts its processes, where a SIGUSR1
    is ignored."""

    def __init__(self, resizes: tuple[Resize, ...], launcher_pid: int, log_dir: Path, tag: str):
        super().__init__("chaos-resizes", bool(resizes))
        self.resizes, self.launcher_pid, self.log_dir, self.tag = resizes, launcher_pid, log_dir, tag
        self.sent: list[str] = []  # what was sent, to which pid, at which step

    def _run(self) -> None:
        pending, earlier = list(self.resizes), set()  # the pids of the launch sent the last change
        while pending and not self._done.wait(POLL_S):
            resize, workers = pending[0], members(self.log_dir, self.tag)
            reached = max((node["step"] or 0 for node in workers.values()), default=-1)
            pids = {node["pid"] for node in workers.values()}
            if len(workers) != resize.before or pids & earlier or reached < resize.step:
                continue
            if resize.action == GROW:
                pid, whom, signum = self.launcher_pid, "the launcher", signal.SIGUSR1
            else:
                node = workers.get(f"worker{resize.index}")
                if node is None:
                    continue
                pid, whom, signum = node["pid"], f"worker {resize.index}", signal.SIGTERM
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue
            self.sent.append(f"resize at step {resize.step}: {signal.Signals(signum).name} to {whom} "
                             f"(pid {pid}) at step {reached}, {resize.before} to {resize.size} workers")
            pending.pop(0)
            earlier = pids
