"""Calls to the coordinator, and the two background threads every node runs beside its work:
`HeartbeatSender` (I am alive, this is my progress, and these are my latest metrics) and
`MembershipWatcher` (who is in the run now).

Training never waits for the coordinator: both threads keep trying quietly while it is
down (it may be restarting) and pick up where they were once it answers again. Every
call carries a deadline.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable

import grpc
import tenacity

from disttrain.coordinator.node_info import capabilities, heartbeat_message
from disttrain.coordinator.reports import NodeMetrics, NodeProgress
from disttrain.core.channels import open_channel
from disttrain.core.errors import DisttrainError
from disttrain.core.tls import TlsFiles
from disttrain.proto import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE = "disttrain.v1.CoordinatorService"
# method -> (request type, response type); every method is unary-unary.
METHODS = {
    "RegisterNode": (pb.RegisterNodeRequest, pb.RegisterNodeReply),
    "SendHeartbeat": (pb.HeartbeatMessage, pb.HeartbeatReply),
    "ReportMetrics": (pb.MetricsReport, pb.MetricsReply),
    "ReportExit": (pb.ExitReport, pb.ExitReply),
    "WatchMembership": (pb.MembershipRequest, pb.Membership),
    "GetClusterStatus": (pb.ClusterStatusRequest, pb.ClusterStatus),
}
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


class CoordinatorError(DisttrainError):
    """A call to the coordinator failed. `code` is the gRPC status code. Recoverable when
    the coordinator is unreachable (`unreachable`): it may be restarting."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code

    @property
    def unreachable(self) -> bool:
        return self.code in UNREACHABLE


class CoordinatorClient:
    """Calls to the coordinator at `address`, each with a deadline of `timeout_s`, each
    carrying `token` when given (a coordinator started with one refuses calls without it),
    over TLS when `tls` is enabled."""

    def __init__(self, address: str, timeout_s: float = 5.0, token: str | None = None,
                 tls: TlsFiles | None = None):
        self.address = address
        self.timeout_s = timeout_s
        # Back within about a second of a restarted coordinator (gRPC's default backoff grows
        # to two minutes after a few failed attempts, and heartbeats would stay paused).
        self.channel = open_channel(address, tls, token, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)])
        self._calls = {name: self.channel.unary_unary(method_path(name),
                                                      request_serializer=request.SerializeToString,
                                                      response_deserializer=reply.FromString)
                       for name, (request, reply) in METHODS.items()}
        self._watches: set[grpc.Future] = set()
        self._lock = threading.Lock()

    def _call(self, name: str, request, timeout_s: float | None = None):
        try:
            return self._calls[name](request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise self._error(name, e) from e

    def _error(self, name: str, error: grpc.RpcError) -> CoordinatorError:
        code = error.code()
        if code in UNREACHABLE:
            return CoordinatorError(f"cannot reach the coordinator at {self.address} ({code.name}); is "
                                    "`disttrain coordinator` running there?", code)
        return CoordinatorError(f"the coordinator at {self.address} refused {name}: {error.details()}", code)

    def register(self, node_id: str, role: str, rank: int = -1, address: str = "",
                 retry_s: float = 60.0, sleep: Callable[[float], None] = tenacity.nap.sleep
                 ) -> pb.RegisterNodeReply:
        """Register this process as `node_id`, retrying with backoff and jitter for up to
        `retry_s` while the coordinator is unreachable (not started yet, restarting);
        `sleep` waits out each backoff (a test passes a recorder, to read the waits).

        Raises:
            CoordinatorError: the id is held by another live process (ALREADY_EXISTS), the
                id or role is invalid, or the coordinator stayed unreachable.
        """
        request = pb.RegisterNodeRequest(node_id=node_id, role=role, rank=rank, address=address,
                                         hostname=socket.gethostname(), pid=os.getpid(),
                                         capabilities=capabilities())
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, CoordinatorError) and e.unreachable),
            wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
            stop=tenacity.stop_after_delay(retry_s), sleep=sleep, reraise=True)
        return retrying(self._call, "RegisterNode", request)

    def heartbeat(self, message: pb.HeartbeatMessage) -> pb.HeartbeatReply:
        """One heartbeat. Raises CoordinatorError (NOT_FOUND: register first)."""
        return self._call("SendHeartbeat", message)

    def report_exit(self, node_id: str, code: int, reason: str) -> pb.ExitReply:
        """Tell the coordinator a node's process exited (0: finished; else: failed)."""
        return self._call("ReportExit", pb.ExitReport(node_id=node_id, exit_code=code, reason=reason))

    def report_metrics(self, node_id: str, metrics: NodeMetrics) -> pb.MetricsReply:
        """Report a node's latest training metrics. Raises CoordinatorError (NOT_FOUND:
        register first)."""
        report = pb.MetricsReport(node_id=node_id, step=metrics.step, epoch=metrics.epoch,
                                  scalars=dict(metrics.scalars))
        return self._call("ReportMetrics", report)

    def watch_membership(self, after_generation: int, timeout_s: float,
                         cancelled: threading.Event | None = None) -> pb.Membership | None:
        """The membership once its generation differs from `after_generation`; None when
        it did not change within `timeout_s`, or the watch was cancelled (`cancel_watches`,
        `close`, or `cancelled` set before `cancel_watches` was called).

        Raises:
            CoordinatorError: the coordinator is unreachable or refused the call.
        """
        future = self._calls["WatchMembership"].future(
            pb.MembershipRequest(after_generation=after_generation), timeout=timeout_s)
        with self._lock:
            self._watches.add(future)
            if cancelled is not None and cancelled.is_set():  # cancel_watches ran before the add
                future.cancel()
        try:
            membership = future.result()
        except grpc.FutureCancelledError:
            return None
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return None
            raise self._error("WatchMembership", e) from e
        finally:
            with self._lock:
                self._watches.discard(future)
        return None if membership.generation == after_generation else membership

    def status(self) -> pb.ClusterStatus:
        """Every node and the latest events. Raises CoordinatorError."""
        return self._call("GetClusterStatus", pb.ClusterStatusRequest())

    def cancel_watches(self) -> None:
        """End every `watch_membership` in progress (each returns None)."""
        with self._lock:
            for future in list(self._watches):
                future.cancel()

    def close(self) -> None:
        self.cancel_watches()
        self.channel.close()


class HeartbeatSender:
    """A daemon thread heartbeating every `interval_s` with this node's progress.

    Call `client.register` first, then `start()`. `progress()` returns the node's
    `NodeProgress`; throughput and step time come from the change since the previous
    heartbeat (step time from the seconds of work when counted: a node that waits for
    slower peers then does not look slow itself), and the heartbeat carries its balance
    state as it is. After each heartbeat answered, `metrics()` (when given) is read and,
    when it returns metrics not reported yet, they are reported (best effort, like the
    heartbeat: a failed report is tried again at the next one). While the coordinator is
    unreachable the thread keeps trying (one warning, one info once it is back); when it
    answers NOT_FOUND (restarted without its registry) the node registers again; when it
    answers alive=False, `on_declared_dead()` is called once and the thread ends.
    """

    def __init__(self, client: CoordinatorClient, node_id: str, role: str, interval_s: float,
                 progress: Callable[[], NodeProgress], on_declared_dead: Callable[[], None],
                 rank: int = -1, address: str = "", generation: int = 0,
                 metrics: Callable[[], NodeMetrics | None] | None = None):
        self.client, self.node_id, self.role = client, node_id, role
        self.interval_s, self.progress, self.on_declared_dead = interval_s, progress, on_declared_dead
        self.rank, self.address, self.generation = rank, address, generation
        self.metrics = metrics
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
        if error.code == grpc.StatusCode.NOT_FOUND:
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
