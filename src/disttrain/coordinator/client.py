"""Calls to the coordinator, each with a deadline; a node's background threads that make
them are `background`'s."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

import grpc
import tenacity

from disttrain.coordinator.node_info import capabilities
from disttrain.coordinator.reports import NodeMetrics
from disttrain.core.channels import open_channel, wrong_service
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

    @property
    def unknown_node(self) -> bool:
        """The coordinator does not know the caller (it restarted without its registry):
        register again."""
        return self.code == grpc.StatusCode.NOT_FOUND

    @property
    def wrong_process(self) -> bool:
        """The coordinator holds the caller's node id for another process (it registered
        again since): this process must stop."""
        return self.code == grpc.StatusCode.FAILED_PRECONDITION


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
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)],
            role="coordinator")  # under the run's CA, only a coordinator's certificate serves
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
        if code in UNREACHABLE and wrong_service(error):
            return CoordinatorError(
                f"the server at {self.address} is not this run's coordinator: its certificate does not "
                "serve as the coordinator of the run of --tls-ca (one of `disttrain tls new --node "
                "coordinator` does); check --coordinator and the server's --tls-cert", code)
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

    def report_exit(self, node_id: str, code: int, reason: str, pid: int = 0,
                    generation: int = 0) -> pb.ExitReply:
        """Tell the coordinator a node's process exited (0: finished; else: failed).

        Args:
            pid, generation: the process that exited and the generation it registered in
                (its RegisterNodeReply's); the coordinator refuses a report about another
                process. 0: the node's current ones, as the coordinator shows them (a
                supervisor or launcher reporting a process it did not register); then
                nothing is sent when the node is not alive, and a report overtaken by the
                node's next registration is dropped.

        Raises:
            CoordinatorError: unreachable, or refused (FAILED_PRECONDITION: `pid` and
                `generation` are not the node's current process's).
        """
        if pid <= 0 or generation <= 0:
            return self._report_exit_of_current(node_id, code, reason)
        return self._call("ReportExit", pb.ExitReport(node_id=node_id, exit_code=code, reason=reason,
                                                      pid=pid, generation=generation))

    def _report_exit_of_current(self, node_id: str, code: int, reason: str) -> pb.ExitReply:
        status = self.status()
        node = next((n for n in status.nodes if n.node_id == node_id), None)
        if node is None or node.state != "alive":  # unknown, or its end is known already
            return pb.ExitReply(known=node is not None, generation=status.generation)
        try:
            return self.report_exit(node_id, code, reason, node.pid, node.joined_generation)
        except CoordinatorError as e:
            if not e.wrong_process:
                raise
            logger.debug("the exit of %s was not reported: a newer process registered meanwhile", node_id)
            return pb.ExitReply(known=True, generation=status.generation)

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
