"""torch's elastic agent, restarting the rank group as the run's restart budget allows.

torch's agent counts every restart of the group against its `max_restarts`, whether the
group had trained for an hour or died at once, and restarts a group that a user's error
stopped as readily as one a kill stopped. Here the agent is given a count it never
spends (`AGENT_MAX_RESTARTS`: the ranks' restart count, their `attempt`, still goes up by
one at each restart), and after each failure of the group it asks the restart budget
(`coordinator.budget`, with `ddp.max_restarts`), and stops the group when the budget says
so:

- progress is the group's newest checkpoint: a restarted group resumes from it, and what
  it trained past it is trained again, so a group that wrote a checkpoint past the newest
  one before its start made progress (restarted for free), and one that did not spends
  one restart (`ddp.max_restarts` of those in a row are allowed);
- a group whose ranks stopped preempted (`Preempted`, after a SIGTERM: `preemption`) is
  not restarted: the launcher says how it ended and the run is resumed by the user;
- a rank that failed with a user's error (its error file names a `DisttrainError` that
  says a restart cannot mend it) stops the group at once, and so does the same unexpected
  error at the same checkpoint on a fresh start; a group in which a rank was killed failed
  from outside, whatever the others said after losing it.

On several nodes each node's agent judges its own group's failures by the checkpoints it
can read: where the nodes share `checkpoint_dir` (a store's URL, a shared folder) they see
the same progress; elsewhere a node without the checkpoints spends a restart at every
failure, as torch's count would.

`elastic_launch` builds its agent itself, from `torch.distributed.launcher.api`'s
`LocalElasticAgent`: `budgeted_agent` puts this one in its place for one launch. The agent's
failure check (`_monitor_workers`) and its count of restarts left (`_remaining_restarts`)
are torch's internals (stable since torchelastic joined torch); a test of the pieces
checks both are there.

Within the same block the agent starts each rank (`python -u -m disttrain.torchrun ...`)
by forking it from the launcher's fork server (`core.forking`: torch imported once, not
once a rank and again at each restart of the group) through torch's own process handler
(`SubprocessHandler._popen`, what torch's elastic multiprocessing calls through
`get_subprocess_handler`); any other command it starts as torch does.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.elastic.multiprocessing.api as elastic_processes
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from disttrain.coordinator.budget import Decision, ErrorReport, RestartBudget, Verdict, error_class
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError, DistributedError, DisttrainError, TrainingError
from disttrain.core.forking import ForkedProcess, ForkServerError, forking
from disttrain.strategies.ddp.preemption import group_stop

logger = logging.getLogger(__name__)

AGENT_MAX_RESTARTS = 1_000_000  # torch's own count: never the one that stops a run
KILL_WAIT_S = 5  # how long the agent waits for killed ranks to be reaped
BUDGET_KEY = "ddp.max_restarts"
GROUP = "the rank group"
POINT = "checkpoint step"
_ORDER = {False: 0, None: 1, True: 2}  # the error that stands for a group's: a user's, unexpected, a fault
_HEAD = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.*)$")


def newest_step(folder: str) -> int | None:
    """The step of the newest checkpoint in `folder` (None: none, or it cannot be read)."""
    try:
        latest = ckpt.latest_checkpoint(folder)
        return None if latest is None else ckpt.checkpoint_step(latest)
    except (DisttrainError, OSError, ValueError) as e:
        logger.warning("could not read the newest checkpoint in %s (%s): the group's progress is taken "
                       "as none", folder, e)
        return None


def rank_error(exitcode: int, message: Any) -> ErrorReport | None:
    """The error a failed rank left in its error file (`Kind: message`), classed by
    whether it says a restart may mend it; exit code 2 without a file: a user's error."""
    if isinstance(message, Mapping):
        message = message.get("message", "")
    text = str(message or "").strip()
    match = _HEAD.match(text.splitlines()[0]) if text else None
    if match is not None:
        kind = match.group(1)
        known = error_class(kind)
        return ErrorReport(kind, match.group(2), None if known is None else known.recoverable)
    if exitcode == ConfigError.exit_code:
        return ErrorReport(ConfigError.__name__, f"exit code {exitcode}", recoverable=False)
    return None


def group_failure(failures: Mapping[int, Any]) -> tuple[str, ErrorReport | None]:
    """How the group failed (one phrase) and the error that stands for it: none when a rank
    was killed (the others only lost it); else a user's error first, then an unexpected
    one, then a fault."""
    # A rank killed by SIGTERM is most often one the group's stop ended after another rank
    # died (which of them the agent sees first depends on the machine's load): name first
    # a rank killed by any other signal.
    killed = sorted((rank for rank, failure in failures.items() if failure.exitcode < 0),
                    key=lambda rank: (failures[rank].exitcode == -signal.SIGTERM, rank))
    if killed:
        failure = failures[killed[0]]
        return f"failed (rank {killed[0]} killed by {failure.signal_name()})", None
    errors = [(rank, rank_error(f.exitcode, f.message)) for rank, f in sorted(failures.items())]
    if not errors:
        return "failed", None
    rank, error = min(errors, key=lambda item: _ORDER[item[1].recoverable] if item[1] else len(_ORDER))
    return f"failed (rank {rank} exited with code {failures[rank].exitcode})", error


@dataclass
class GroupBudget:
    """The restart budget of this node's rank group, judged at each failure of the group.

    Args:
        max_restarts: `ddp.max_restarts`.
        checkpoint_dir: where the group's checkpoints are (a path or a store's URL).
        clock: monotonic seconds.
    """

    max_restarts: int
    checkpoint_dir: str
    clock: Callable[[], float] = time.monotonic
    budget: RestartBudget = field(init=False)
    stopped: tuple[Verdict, str] | None = None  # the verdict that stopped the group, and its reason

    def __post_init__(self) -> None:
        # A resumed run's checkpoints are where it starts from, not progress of this launch.
        self.budget = RestartBudget(self.max_restarts, furthest=newest_step(self.checkpoint_dir))
        self.budget.started(self.clock())

    def failed(self, failures: Mapping[int, Any]) -> Verdict:
        """Judge one failure of the group (`failures`: global rank -> torch's ProcessFailure)."""
        reason, error = group_failure(failures)
        verdict = self.budget.exited(self.clock(), newest_step(self.checkpoint_dir), error)
        if verdict.restart:
            logger.warning("%s", verdict.restart_line(GROUP, reason, BUDGET_KEY, POINT))
            self.budget.started(self.clock())
        else:
            self.stopped = (verdict, reason)
        return verdict

    def stop_error(self) -> DisttrainError | None:
        """The error the run stops with, when the budget stopped the group."""
        if self.stopped is None:
            return None
        verdict, reason = self.stopped
        if verdict.decision is Decision.STOP_USER_ERROR:
            assert verdict.error is not None
            name = re.sub(r"^failed \((rank \d+) .*", r"\1", reason)
            return (error_class(verdict.error.kind) or TrainingError)(  # a ConfigError exits with 2
                verdict.stop_line(name, reason, BUDGET_KEY))
        line = verdict.stop_line(GROUP, reason, BUDGET_KEY, point=POINT)
        if verdict.decision is Decision.STOP_REPEATED_ERROR:
            return TrainingError(line)
        return DistributedError(line)


class PreemptibleAgent(LocalElasticAgent):
    """torch's local agent, whose shutdown a second signal cuts short.

    On a signal (SIGTERM: the job preempted) torch's agent forwards it to the ranks and
    waits for them up to its shutdown timeout (the grace period). A second signal raises
    inside that wait, and torch then shuts down again, waiting as long once more; here the
    shutdown that follows an interrupted one kills the ranks at once (`second_signal`).
    """

    second_signal = False
    _closing = False

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._closing:  # the last shutdown did not return: a second signal cut it short
            self.second_signal = True
            death_sig, timeout = signal.SIGKILL, KILL_WAIT_S
        self._closing = True
        super()._shutdown(death_sig, timeout)
        self._closing = False


class BudgetedAgent(PreemptibleAgent):
    """torch's local agent whose every restart of a failed group is the budget's to grant."""

    def __init__(self, budget: GroupBudget, **kwargs: Any):
        spec = kwargs["spec"]
        spec.max_restarts = AGENT_MAX_RESTARTS
        super().__init__(**kwargs)
        self.budget = budget

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        if group_stop(failure.message for failure in result.failures.values()) is not None or \
                not self.budget.failed(result.failures).restart:
            self._remaining_restarts = 0  # the agent stops the group and returns its failure
        return result


class ForkedRankHandler(SubprocessHandler):
    """torch's handler of one rank's process, the process forked from the fork server."""

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        if forking() and len(args) > 3 and args[0] == sys.executable and tuple(args[1:3]) == ("-u", "-m"):
            stdout = self._stdout.fileno() if self._stdout else sys.stdout.fileno()
            stderr = self._stderr.fileno() if self._stderr else sys.stderr.fileno()
            try:
                return ForkedProcess([str(a) for a in args[3:]], env, stderr, stdout=stdout)
            except ForkServerError as e:
                logger.warning("%s; starting the rank as a new interpreter", e)
        return super()._popen(args, env)

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """torch's close, for a rank that ended since torch saw it running: its fork server
        reaps it at once, so its process group may be gone already (a `Popen` child stays
        a zombie, its group with it, until waited for), and there is nothing to signal."""
        try:
            super().close(death_sig)
        except ProcessLookupError:
            for stream in (self._stdout, self._stderr):
                if stream:
                    stream.close()


def _forked_rank_handler(**handler: Any) -> SubprocessHandler:
    """`get_subprocess_handler`'s stand-in: its keywords (entrypoint, args, env, stdout,
    stderr, local_rank_id, numa_options) go to the handler as they are."""
    return ForkedRankHandler(**handler)


@contextmanager
def budgeted_agent(budget: GroupBudget | None) -> Iterator[list[PreemptibleAgent]]:
    """Within the block, `elastic_launch` runs a `BudgetedAgent` of `budget` (None: a
    `PreemptibleAgent`, restarting as torch's own does), which forks its ranks from the
    fork server; yields the agents made."""
    made: list[PreemptibleAgent] = []

    def make(**kwargs: Any) -> PreemptibleAgent:
        made.append(PreemptibleAgent(**kwargs) if budget is None else BudgetedAgent(budget, **kwargs))
        return made[-1]

    original = launcher_api.LocalElasticAgent, elastic_processes.get_subprocess_handler
    launcher_api.LocalElasticAgent = make
    elastic_processes.get_subprocess_handler = _forked_rank_handler
    try:
        yield made
    finally:
        launcher_api.LocalElasticAgent, elastic_processes.get_subprocess_handler = original
