"""A DDP rank's tie to the run's coordinator, when the run has one (`coordinator.address`):
register as node `rank{R}` (role "rank"), heartbeat with the training loop's progress,
report its latest metrics, and report how the rank ended.

The coordinator only watches a DDP run: torch's elastic agent detects a dead rank and
restarts the group. So nothing here ever stops or delays training: a coordinator that
cannot be reached, or that refuses the registration for now, is tried again in the
background every heartbeat interval; a rank the coordinator declared failed (it went
silent, e.g. its machine stalled, while it trained on) registers again.

An elastic restart starts every rank afresh while the coordinator may still count the
rank's previous process alive (a SIGKILLed process reports nothing, and the others were
stopped by the agent). The new process first reports that one's end, so its registration
counts as a restart of the rank instead of clashing with a live process of the same id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.background import HeartbeatSender
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.node_info import heartbeat_message
from disttrain.coordinator.reports import LatestMetrics, NodeIdentity, NodeProgress, NodeReports
from disttrain.core.credentials import Credentials
from disttrain.core.errors import DisttrainError, error_lines
from disttrain.proto import coordinator_pb2 as pb
from disttrain.training.checkpoints import Position
from disttrain.training.rebalance import Rebalancer

logger = logging.getLogger(__name__)

ROLE = "rank"
CALL_TIMEOUT_S = 2.0  # each call to the coordinator; a rank never waits on it for longer
PREVIOUS_EXIT_CODE = 1  # the previous process's own code is the agent's to know, not ours
ELASTIC_RESTART = "the elastic agent restarted the rank group"
LIVE_RESTART = "the launcher started the rank again and it rejoined the running group"


def node_id(rank: int) -> str:
    """The coordinator's id of global rank `rank`, the same across restarts."""
    return f"rank{rank}"


@dataclass
class LoopProgress:
    """What a rank's heartbeats read: the training loop's position, the rank's balance
    state and its latest metrics. The loop updates `position` in place (a resume loads the
    checkpoint's into it), so a heartbeat thread reads it live; `rebalancer` (set once the
    balance plan exists; None: not balanced) holds the balance state; the loop publishes
    every record it logs into `metrics`."""

    position: Position
    num_epochs: int
    rebalancer: Rebalancer | None = None
    metrics: LatestMetrics = field(default_factory=LatestMetrics)

    def __call__(self) -> NodeProgress:
        """Where the loop is (after the last epoch: that epoch), with the balance state. No
        seconds of work: the heartbeat times steps by the wall clock."""
        position, rebalancer = self.position, self.rebalancer
        return NodeProgress(min(position.epoch, self.num_epochs - 1), position.step,
                            position.samples_processed, None,
                            None if rebalancer is None else rebalancer.balance)

    def averages(self) -> tuple[float, float]:
        """(samples per second, seconds per step) over the training clock so far; valid
        once the loop has ended (the clock's reading is stored then)."""
        position = self.position
        if position.train_time_s <= 0 or position.step == 0:
            return 0.0, 0.0
        return position.samples_processed / position.train_time_s, position.train_time_s / position.step


class RankLink:
    """One rank's registration and heartbeats. Call `start()`, then `leave()` once.

    Args:
        client: calls to the coordinator.
        settings: the `coordinator` config section (heartbeat interval).
        rank: the global rank.
        restart_count: the elastic agent's restart number (> 0: an earlier process of this
            rank ran and its end has to be reported first).
        progress: read at every heartbeat.
    """

    def __init__(self, client: CoordinatorClient, settings: CoordinatorConfig, rank: int,
                 restart_count: int, progress: LoopProgress, restarted_by: str = ELASTIC_RESTART):
        self.client, self.settings, self.rank = client, settings, rank
        self.restarted_by = restarted_by
        self.node_id = node_id(rank)
        self.restart_count, self.progress = restart_count, progress
        self._previous_reported = restart_count == 0
        self._heartbeats: HeartbeatSender | None = None
        self._retrying: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._warned = False

    def start(self) -> None:
        """Register now, or (coordinator unreachable or refusing) keep trying in the background."""
        if not self._join():
            self._retry_in_background()

    def _join(self) -> bool:
        """Report the previous process's end (after a restart), register, start heartbeats.
        Returns False when this has to be tried again."""
        try:
            if not self._previous_reported:
                reason = f"its process ended; {self.restarted_by} (restart {self.restart_count})"
                self.client.report_exit(self.node_id, PREVIOUS_EXIT_CODE, reason)
                self._previous_reported = True
            reply = self.client.register(self.node_id, ROLE, rank=self.rank, retry_s=0)
        except CoordinatorError as e:
            self._warn_once(e)
            return False
        with self._lock:
            if self._stopped.is_set():
                return True
            self._heartbeats = HeartbeatSender(self.client, NodeIdentity(self.node_id, ROLE, self.rank),
                                               self.settings.heartbeat_interval,
                                               NodeReports(self.progress, self.progress.metrics.latest),
                                               self._declared_failed, generation=reply.generation)
            self._heartbeats.start()
        if self._warned:
            logger.info("%s joined the coordinator at %s at last", self.node_id, self.client.address)
        else:
            logger.debug("%s joined the coordinator at %s (generation %d, %d restart(s) before)",
                         self.node_id, self.client.address, reply.generation, reply.restarts)
        self._warned = False
        return True

    def _warn_once(self, error: CoordinatorError) -> None:
        if self._warned:
            return
        self._warned = True
        if error.code == grpc.StatusCode.ALREADY_EXISTS:
            logger.warning("%s: %s; training goes on, and it tries again every %gs", self.node_id, error,
                           self.settings.heartbeat_interval)
        else:
            logger.warning("%s is not registered with the coordinator (training goes on; it tries again "
                           "every %gs): %s", self.node_id, self.settings.heartbeat_interval, error)

    def _retry_in_background(self) -> None:
        def retry() -> None:
            while not self._stopped.wait(self.settings.heartbeat_interval):
                if self._join():
                    return

        with self._lock:
            if self._stopped.is_set():
                return
            self._retrying = threading.Thread(target=retry, name="coordinator-join", daemon=True)
            self._retrying.start()

    def _declared_failed(self) -> None:
        """The coordinator counts this rank failed while it trains on: join again (its heartbeat
        thread ends after this returns)."""
        logger.warning("the coordinator declared %s failed, but it trains on (the elastic agent, not "
                       "the coordinator, restarts DDP ranks); registering again", self.node_id)
        self._retry_in_background()

    def leave(self, code: int, reason: str, final: bool = False) -> None:
        """Stop heartbeating and tell the coordinator how this rank ended (best effort).

        Args:
            code: 0 (the coordinator marks the rank done) or the rank's exit code (failed).
            final: send one last heartbeat with the final step and the run's average
                throughput, and the latest metrics, first, so the registry shows where the
                rank ended.
        """
        with self._lock:
            self._stopped.set()
            heartbeats, retrying = self._heartbeats, self._retrying
        if retrying is not None:
            retrying.join(timeout=CALL_TIMEOUT_S * 2 + 1.0)
        if heartbeats is not None:
            heartbeats.stop()
            try:
                if final:
                    self.client.heartbeat(self._final_heartbeat(heartbeats.generation))
                    heartbeats.send_metrics()
                self.client.report_exit(self.node_id, code, reason)
            except CoordinatorError as e:
                logger.warning("could not tell the coordinator that %s ended (%s): %s", self.node_id,
                               reason, e)
        self.client.close()

    def _final_heartbeat(self, generation: int) -> pb.HeartbeatMessage:
        throughput, step_time_s = self.progress.averages()
        return heartbeat_message(self.node_id, ROLE, self.progress(), generation, throughput, step_time_s)


@contextmanager
def coordinator_link(settings: CoordinatorConfig, rank: int, restart_count: int,
                     progress: LoopProgress, credentials: Credentials | None = None,
                     restarted_by: str = ELASTIC_RESTART) -> Iterator[RankLink | None]:
    """Be registered with the run's coordinator while the block runs (nothing without one);
    every call to it carries the token of `credentials` when given, over TLS when its TLS
    files are enabled;
    `restarted_by` says how a restarted rank's previous process was replaced.

    Leaving the block normally reports the rank done; by an exception, failed with the
    exception's exit code and first line (the exception goes on). A rank killed outright
    reports nothing: its next process (or the launcher) does.
    """
    if not settings.address:
        yield None
        return
    credentials = credentials or Credentials()
    client = CoordinatorClient(settings.address, timeout_s=CALL_TIMEOUT_S, token=credentials.token,
                               tls=credentials.tls)
    link = RankLink(client, settings, rank, restart_count, progress, restarted_by)
    link.start()
    try:
        yield link
    except BaseException as e:
        code = e.exit_code if isinstance(e, DisttrainError) else 1
        reason = error_lines(e)[0] if isinstance(e, DisttrainError) else _first_line(e)
        link.leave(code, reason)
        raise
    link.leave(0, "finished", final=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
