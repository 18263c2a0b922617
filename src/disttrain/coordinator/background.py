"""The two background threads every node runs beside its work: `HeartbeatSender` (I am
alive, this is my progress, and these are my latest metrics) and `MembershipWatcher` (who
is in the run now).

Training never waits for the coordinator: both threads keep trying quietly while it is
down (it may be restarting) and pick up where they were once it answers again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.node_info import heartbeat_message
from disttrain.coordinator.reports import NodeIdentity, NodeMetrics, NodeReports
from disttrain.proto import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class HeartbeatSender:
    """A daemon thread heartbeating every `interval_s` with this node's progress.

    Call `client.register` first, then `start()`. `reports.progress()` returns the node's
    `NodeProgress`; throughput and step time come from the change since the previous
    heartbeat (step time from the seconds of work when counted: a node that waits for
    slower peers then does not look slow itself), and the heartbeat carries its balance
    state as it is. After each heartbeat answered, `reports.metrics()` (when given) is read and,
    when it returns metrics not reported yet, they are reported (best effort, like the
    heartbeat: a failed report is tried again at the next one). While the coordinator is
    unreachable the thread keeps trying (one warning, one info once it is back); when it
    answers NOT_FOUND (restarted without its registry) the node registers again; when it
    answers alive=False, `on_declared_dead()` is called once and the thread ends.
    """

    def __init__(self, client: CoordinatorClient, node: NodeIdentity, interval_s: float,
                 reports: NodeReports, on_declared_dead: Callable[[], None], generation: int = 0):
        self.client, self.node_id, self.role = client, node.node_id, node.role
        self.interval_s, self.progress, self.on_declared_dead = interval_s, reports.progress, on_declared_dead
        self.rank, self.address, self.generation = node.rank, node.address, generation
        self.metrics = reports.metrics
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._previous: tuple[float, int, int, float] | None = None
        self._unreachable = False
        self._metrics_lock = threading.Lock()  # the thread, and a last report as the node leaves
        self._metrics_sent: NodeMetrics | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.client.timeout_s + 1.0)

    def last_beat(self) -> None:
        """Stop the thread, then send one last heartbeat, so the coordinator holds where the
        node ended, and its latest metrics (best effort: a refusal is logged, not acted on,
        since the node is leaving anyway)."""
        self.stop()
        try:
            self.client.heartbeat(self._message())
        except CoordinatorError as e:
            logger.debug("the last heartbeat of %s was not taken: %s", self.node_id, e)
        self.send_metrics()

    def _run(self) -> None:
        while True:
            if not self._beat() or self._stopped.wait(self.interval_s):
                return

    def _message(self) -> pb.HeartbeatMessage:
        progress = self.progress()
        now = time.monotonic()
        busy = now if progress.work_s is None else progress.work_s
        step, samples = progress.step, progress.samples
        throughput = step_time_s = 0.0
        if self._previous is not None:
            then, last_step, last_samples, last_busy = self._previous
            throughput = (samples - last_samples) / max(now - then, 1e-9)
            step_time_s = (busy - last_busy) / (step - last_step) if step > last_step else 0.0
        self._previous = (now, step, samples, busy)
        return heartbeat_message(self.node_id, self.role, progress, self.generation, throughput, step_time_s)

    def _beat(self) -> bool:
        """One heartbeat (and the metrics, when new); False once this node was declared dead."""
        try:
            reply = self.client.heartbeat(self._message())
        except CoordinatorError as e:
            if e.wrong_process:  # another process holds the id now
                logger.error("the coordinator refused the heartbeat of %s: %s; stopping", self.node_id, e)
                self.on_declared_dead()
                return False
            self._on_error(e)
            return True
        if self._unreachable:
            logger.info("the coordinator at %s answers again", self.client.address)
            self._unreachable = False
        if not reply.alive:
            logger.error("the coordinator declared %s dead; stopping", self.node_id)
            self.on_declared_dead()
            return False
        self.send_metrics()
        return True

    def send_metrics(self) -> bool:
        """Report the node's latest metrics unless they were reported already (best effort:
        an error is logged at debug level; the heartbeat reports the coordinator's state).
        Safe to call from another thread, e.g. once more as the node leaves.

        Returns:
            False when a report was due and failed.
        """
        if self.metrics is None:
            return True
        with self._metrics_lock:
            latest = self.metrics()
            if latest is None or latest is self._metrics_sent:
                return True
            try:
                self.client.report_metrics(self.node_id, latest)
            except CoordinatorError as e:
                logger.debug("the metrics of %s were not reported (tried again later): %s", self.node_id, e)
                return False
            self._metrics_sent = latest
            return True

    def _on_error(self, error: CoordinatorError) -> None:
        if error.unknown_node:
            logger.warning("the coordinator does not know %s (restarted without its registry?); "
                           "registering again", self.node_id)
            try:
                reply = self.client.register(self.node_id, self.role, self.rank, self.address, retry_s=0)
                self.generation = reply.generation
            except CoordinatorError as e:
                logger.warning("registering %s again failed: %s", self.node_id, e)
        elif not self._unreachable:
            logger.warning("heartbeats of %s paused (training goes on): %s", self.node_id, error)
            self._unreachable = True


class MembershipWatcher:
    """A daemon thread long-polling the membership, calling `on_change(membership)` for every
    new generation. Survives coordinator restarts (retries with backoff and jitter)."""

    def __init__(self, client: CoordinatorClient, on_change: Callable[[pb.Membership], None],
                 poll_s: float = 5.0, max_backoff_s: float = 2.0):
        self.client, self.on_change = client, on_change
        self.poll_s, self.max_backoff_s = poll_s, max_backoff_s
        self.generation = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self.client.cancel_watches()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 1.0)

    def _run(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            try:
                membership = self.client.watch_membership(self.generation, self.poll_s, self._stopped)
            except CoordinatorError as e:
                if failures == 0:
                    logger.warning("watching the membership: %s; retrying", e)
                failures += 1
                backoff_s = min(self.max_backoff_s, 0.05 * 2 ** min(failures, 10))
                self._stopped.wait(random.uniform(backoff_s / 2, backoff_s))
                continue
            failures = 0
            if membership is not None and not self._stopped.is_set():
                self.generation = membership.generation
                self.on_change(membership)
