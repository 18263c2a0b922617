"""The supervisor of a run on one machine: it starts each process, and when one fails
(its process exits with an error, or the coordinator declares it failed because it
stopped heartbeating) it tells the coordinator, kills what is left of it, and starts it
again, resuming, as its restart budget (`coordinator.budget`) allows: a process that made
progress before it died is restarted without spending the budget; `max_restarts` failures
in a row without progress spend it, and one more stops the run, but for an *expendable*
process (a parameter-server worker whose blocks the others take over once the
coordinator reassigns it, a live DDP rank): the run goes on without it. A process that
fails with a user's error stops the run at once, whatever the budget.

Progress and errors come from the processes themselves, as event lines the cluster keeps
on each child (`core.processes`): the furthest step (a shard's version) each start
reached, and the error it failed with. They arrive on the process's own output, before
its exit, whether or not the coordinator is up.

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

from disttrain.coordinator.budget import Decision, ErrorReport, RestartBudget, Verdict, error_class
from disttrain.core.errors import ConfigError, DistributedError, TrainingError
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import Child, Cluster

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
    budget: RestartBudget | None = None  # set by the supervisor at its first start


@dataclass
class Failure:
    """One failure and its recovery, as the supervisor saw it (monotonic seconds)."""

    name: str
    reason: str
    exited_at: float
    restarted_at: float | None = None
    progressed: bool = False  # it had made progress: restarted without spending the budget


@dataclass
class Supervisor:
    """Starts, watches and restarts the processes of one run.

    Args:
        cluster: where the processes run.
        max_restarts: each process's restart budget: restarts without progress allowed
            in a row (see `coordinator.budget`); 0: no restarts.
        report_exit: tells the coordinator a process exited (node id, code, reason);
            best effort, the run goes on without a coordinator.
        budget_key: the config key of `max_restarts`, for messages.
        without_it: what becomes of the run without an expendable process given up.
        clock: monotonic seconds.
    """

    cluster: Cluster
    max_restarts: int
    report_exit: Callable[[str, int, str], None] = lambda node_id, code, reason: None
    budget_key: str = "coordinator.max_restarts"
    without_it: str = "the other workers take over its blocks once the coordinator reassigns it"
    clock: Callable[[], float] = time.monotonic
    processes: dict[str, Managed] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)

    def start(self, process: Managed) -> None:
        self.processes[process.name] = process
        process.budget = RestartBudget(self.max_restarts)
        process.budget.started(self.clock())
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

    def ended(self, name: str, code: int) -> str:
        """Tell the coordinator `name` exited with `code` (0: it finished), and nothing else
        (as the run ends, nothing is restarted); the reason told ("" for a process not
        supervised, of which nothing is told)."""
        process = self.processes.get(name)
        if process is None:
            return ""
        if code == 0:
            process.finished = True
            reason = "finished"
        else:
            reason = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.report_exit(process.node_id, code, reason)
        return reason

    def exited(self, name: str, code: int) -> bool:
        """Handle the exit of `name`; True when it was restarted. Its restart budget decides,
        from what its process reported (see the module's docstring).

        Raises:
            ConfigError, InputFileError, DataError, CheckpointError, TrainingError: it failed
                with a user's error (the same class, its message), or with the same
                unexpected error at the same step on a fresh start (TrainingError).
            DistributedError: it failed too often in a row without progress (and is not
                expendable).
        """
        process = self.processes.get(name)
        reason = self.ended(name, code)
        if process is None or code == 0:
            return False
        child = self.cluster.children[name]
        assert process.budget is not None, "started by the supervisor"
        verdict = process.budget.exited(self.clock(), child.furthest, error_of(child, code))
        failure = Failure(name, reason, time.monotonic(), progressed=verdict.progressed)
        self.failures.append(failure)
        if not verdict.restart:
            self._stop(process, child, reason, verdict)
            return False
        process.attempts += 1
        logger.warning("%s", verdict.restart_line(name, reason, self.budget_key))
        self.cluster.spawn(name, process.spec(process.attempts))
        process.budget.started(self.clock())
        failure.restarted_at = time.monotonic()
        return True

    def _stop(self, process: Managed, child: Child, reason: str, verdict: Verdict) -> None:
        """Stop the run for `verdict` (or, past its budget, go on without an expendable process).

        Raises:
            DisttrainError: see `exited`.
        """
        given_up = process.expendable and verdict.decision is Decision.STOP_CRASH_LOOP
        line = verdict.stop_line(process.name, reason, self.budget_key, given_up)
        if verdict.decision is Decision.STOP_USER_ERROR:
            assert verdict.error is not None
            raise (error_class(verdict.error.kind) or TrainingError)(line)  # a ConfigError exits with 2
        if verdict.decision is Decision.STOP_REPEATED_ERROR:
            raise TrainingError(f"{line}; its log: {child.log_path}")
        if given_up:
            process.given_up = True
            logger.warning("%s; the run goes on without it: %s", line, self.without_it)
            return
        tail = child.tail(3).replace("\n", " | ")
        raise DistributedError(f"{line}. Its log {child.log_path} ends: {tail}")


def error_of(child: Child, code: int) -> ErrorReport | None:
    """The error `child` reported on its way out; for an exit with code 2 (bad input)
    without a report, a user's error whose message is its log's last line."""
    fields = child.error
    if fields is not None:
        recoverable = fields.get("recoverable")
        return ErrorReport(str(fields.get("exception", "")), str(fields.get("message", "")),
                           recoverable if isinstance(recoverable, bool) else None)
    if code == ConfigError.exit_code:
        last = child.tail(1).strip()
        return ErrorReport(ConfigError.__name__, last.removeprefix("error:").strip() or f"exit code {code}",
                           recoverable=False)
    return None
