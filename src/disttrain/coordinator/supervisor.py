"""The supervisor of a run on one machine: it starts each process, and when one fails
(its process exits with an error, or the coordinator declares it failed because it
stopped heartbeating) it tells the coordinator, kills what is left of it, and starts it
again, resuming, up to `max_restarts` times per process. One failure more stops the run,
but for an *expendable* process (a parameter-server worker whose blocks the others take
over once the coordinator reassigns it): the run goes on without it.

The supervisor lives in the launcher (`disttrain ps`); the coordinator is one of its
children, so a coordinator that dies is restarted like any other process.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disttrain.core.errors import DistributedError
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import Cluster

logger = logging.getLogger(__name__)


@dataclass
class Managed:
    """One supervised process.

    Args:
        name: its name in the cluster (and its log file's).
        node_id: its id at the coordinator.
        spec: the process of attempt N (0: the first start; later ones resume).
        expendable: the run goes on without it once its restarts are spent.
    """

    name: str
    node_id: str
    spec: Callable[[int], ProcessSpec]
    expendable: bool = False
    attempts: int = 0
    finished: bool = False
    given_up: bool = False  # expendable, failed past its restarts: not started again


@dataclass
class Failure:
    """One failure and its recovery, as the supervisor saw it (monotonic seconds)."""

    name: str
    reason: str
    exited_at: float
    restarted_at: float | None = None


@dataclass
class Supervisor:
    """Starts, watches and restarts the processes of one run.

    Args:
        cluster: where the processes run.
        max_restarts: restarts allowed per process; one more failure stops the run.
        report_exit: tells the coordinator a process exited (node id, code, reason);
            best effort, the run goes on without a coordinator.
    """

    cluster: Cluster
    max_restarts: int
    report_exit: Callable[[str, int, str], None] = lambda node_id, code, reason: None
    processes: dict[str, Managed] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)

    def start(self, process: Managed) -> None:
        self.processes[process.name] = process
        self.cluster.spawn(process.name, process.spec(process.attempts))

    def by_node(self, node_id: str) -> Managed | None:
        return next((p for p in self.processes.values() if p.node_id == node_id), None)

    def declared_failed(self, node_id: str, reason: str, pid: int = 0) -> None:
        """The coordinator declared `node_id` failed (silent past its heartbeat timeout):
        kill its process if it still runs (it hangs); its exit then restarts it. `pid`, when
        given, is the process the coordinator last heard of: a newer one is left alone."""
        process = self.by_node(node_id)
        if process is None or process.finished or process.given_up:
            return
        child = self.cluster.children.get(process.name)
        if child is not None and child.process.poll() is None and pid in (0, child.process.pid):
            logger.warning("%s stopped heartbeating (%s); killing it to restart it", process.name, reason)
            try:
                os.killpg(child.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def exited(self, name: str, code: int) -> bool:
        """Handle the exit of `name`; True when it was restarted.

        Raises:
            DistributedError: it failed more than `max_restarts` times (and is not expendable).
        """
        process = self.processes.get(name)
        if process is None:
            return False
        if code == 0:
            process.finished = True
            self.report_exit(process.node_id, 0, "finished")
            return False
        reason = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.report_exit(process.node_id, code, reason)
        failure = Failure(name, reason, time.monotonic())
        self.failures.append(failure)
        if process.attempts >= self.max_restarts and process.expendable:
            process.given_up = True
            logger.warning("%s %s after %d restart(s) (coordinator.max_restarts=%d); the run goes on "
                           "without it, and the other workers take over its blocks once the coordinator "
                           "reassigns it", name, reason, process.attempts, self.max_restarts)
            return False
        if process.attempts >= self.max_restarts:
            child = self.cluster.children[name]
            tail = child.tail(3).replace("\n", " | ")
            raise DistributedError(
                f"{name} {reason} after {process.attempts} restart(s) (coordinator.max_restarts="
                f"{self.max_restarts}); the cluster was stopped. Its log {child.log_path} ends: {tail}")
        process.attempts += 1
        logger.warning("%s %s; restarting it (restart %d of at most %d)", name, reason, process.attempts,
                       self.max_restarts)
        self.cluster.spawn(name, process.spec(process.attempts))
        failure.restarted_at = time.monotonic()
        return True
