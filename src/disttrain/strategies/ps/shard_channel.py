"""One shard's server as the worker reaches it: the channel, every call's deadline and
retries, the worker's registration and its session, and shared memory when offered.

Every RPC carries a deadline (`ps.rpc_timeout_s`); transient failures (server not up
yet or restarting, deadline passed) are retried with exponential backoff and jitter.
Retrying a push is safe: the server acknowledges a (worker, step) it already took as a
duplicate. The payload calls (push, pull, step) are `shard_client.ShardClient`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import tenacity

from disttrain.core.auth import with_token
from disttrain.core.errors import DistributedError
from disttrain.core.tls import TlsFiles
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import wire
from disttrain.strategies.ps.sharding import ShardPlan
from disttrain.strategies.ps.shared_memory import SegmentPair, SharedMemoryUnavailable
from disttrain.strategies.ps.step_stream import StreamBroken

logger = logging.getLogger(__name__)

TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


@dataclass(frozen=True)
class RetryPolicy:
    """Deadline of each attempt, and how often and how patiently to retry. The default
    rides out a server's restart (tens of seconds of UNAVAILABLE). `sleep` waits out each
    backoff (a test passes a recorder, to read the waits without waiting them)."""

    timeout_s: float = 60.0
    max_attempts: int = 30
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 3.0
    sleep: Callable[[float], None] = tenacity.nap.sleep


class ReplyLost(ConnectionError):
    """An injected fault: the server took the push but its reply never came back."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, ReplyLost | StreamBroken) or \
        isinstance(error, grpc.RpcError) and error.code() in TRANSIENT


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


class ShardChannel:
    """Calls to one shard's server at `address`. Payload bytes travel in the gRPC
    messages, or through shared memory once `segments` are attached (same machine). Every
    call carries `token` when given (a server started with one refuses calls without it),
    over TLS when `tls` is enabled."""

    def __init__(self, address: str, shard: int, policy: RetryPolicy, token: str | None = None,
                 tls: TlsFiles | None = None):
        self.address = address
        self.shard = shard
        self.policy = policy
        self.segments: SegmentPair | None = None
        # The server's incarnation as last heard: another one means it restarted.
        self.incarnation = 0
        self.session = b""  # this worker's session on the shard, from its registration
        self._joined: tuple | None = None
        self.drop_replies = 0  # replies of pushes to lose on purpose (fault injection)
        self._join_lock = threading.Lock()
        self.channel = with_token((tls or TlsFiles()).channel(address, options=wire.CHANNEL_OPTIONS), token)
        self._calls = {}
        for name, (kind, request_type, response_type) in wire.METHODS.items():
            serialize = wire.identity if request_type is None else request_type.SerializeToString
            deserialize = wire.read_parameters if response_type is None else response_type.FromString
            self._calls[name] = getattr(self.channel, kind)(
                wire.method_path(name), request_serializer=serialize, response_deserializer=deserialize)

    def _retry(self, what: str, fn: Callable[[], object], renew: bool = True):
        """`fn` until it answers, retried while it fails transiently. A call refused for
        its session, by a server that restarted since this worker registered, is made
        again once after registering anew."""
        policy = self.policy

        def log_retry(state: tenacity.RetryCallState) -> None:
            logger.warning("%s on %s failed (%s); retry %d in %.2fs", what, self.address,
                           describe(state.outcome.exception()), state.attempt_number,
                           state.upcoming_sleep)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            wait=tenacity.wait_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s)
            + tenacity.wait_random(0, policy.initial_backoff_s),  # jitter: retries of many workers spread out
            stop=tenacity.stop_after_attempt(policy.max_attempts), before_sleep=log_retry,
            sleep=policy.sleep, reraise=True)
        session = self.session
        try:
            return retrying(fn)
        except grpc.RpcError as e:
            if renew and e.code() == grpc.StatusCode.PERMISSION_DENIED and self._renew(session):
                return self._retry(what, fn, renew=False)
            raise DistributedError(f"{what} on shard {self.shard} at {self.address} failed: "
                                   f"{describe(e)}") from e

    def _renew(self, refused: bytes) -> bool:
        """After a call was refused for carrying session `refused`: whether registering
        again may help (the session changed meanwhile, or the server restarted), having
        registered again; False when another process has taken this worker's id."""
        if self._joined is None:
            return False
        if self.session != refused:
            return True
        status = self._retry("GetStatus", lambda: self._calls["GetStatus"](
            pb.StatusRequest(), timeout=self.policy.timeout_s, wait_for_ready=True), renew=False)
        if status.incarnation == self.incarnation:
            return False
        self.rejoin(status.incarnation)
        return True

    def _stamped(self, request):
        """`request` with this worker's session, when its kind carries one (a copy: one
        request may go to every shard at once)."""
        if "session" not in request.DESCRIPTOR.fields_by_name:
            return request
        stamped = type(request)()
        stamped.CopyFrom(request)
        stamped.session = self.session
        return stamped

    def unary(self, name: str, request, timeout_s: float | None = None):
        timeout = self.policy.timeout_s if timeout_s is None else timeout_s
        return self._retry(name, lambda: self._calls[name](self._stamped(request), timeout=timeout,
                                                           wait_for_ready=True))

    def join(self, request: pb.RegisterRequest, plan: ShardPlan, num_shards: int, memory_required: bool
             ) -> pb.WorkerAssignment:
        """Register with this shard and map its shared memory when offered; kept, so a
        restarted server is joined again the same way (`rejoin`).

        Raises:
            DistributedError: the server holds another shard or model than `plan`.
        """
        assignment = self.unary("RegisterWorker", request)
        if assignment.num_shards != num_shards or assignment.shard != self.shard:
            raise DistributedError(f"server {self.address} holds shard {assignment.shard}/"
                                   f"{assignment.num_shards}, but it was given as shard "
                                   f"{self.shard}/{num_shards}; list servers in shard order")
        if wire.plan_layout(assignment.layout) != plan.slices or assignment.dtype != plan.dtype:
            raise DistributedError(f"server {self.address} holds a different model than this "
                                   "worker; start servers and workers with the same config")
        self.segments = None
        if assignment.HasField("shared_memory"):
            self.attach(assignment.shared_memory, plan, memory_required)
        elif memory_required:
            raise DistributedError(f"server {self.address} offered no shared memory; use "
                                   "ps.payload_transport: auto or grpc")
        self.incarnation, self.session = assignment.incarnation, assignment.session
        self._joined = (pb.RegisterRequest(), plan, num_shards, memory_required)
        self._joined[0].CopyFrom(request)
        self._joined[0].requested_rank = assignment.rank
        return assignment

    def rejoin(self, incarnation: int) -> None:
        """Register again with a server that restarted as `incarnation` (it makes new
        shared-memory segments); once, however many calls noticed the restart."""
        with self._join_lock:
            if self.incarnation != incarnation:
                logger.warning("shard %d at %s restarted; registering with it again", self.shard,
                               self.address)
                self.join(*self._joined)

    def attach(self, offer: pb.SharedMemoryOffer, plan: ShardPlan, required: bool) -> None:
        """Map the server's shared-memory segments, or stay with gRPC bytes when they
        cannot be mapped from here (another machine).

        Raises:
            DistributedError: `required`, and the segments cannot be mapped.
        """
        try:
            self.segments = SegmentPair.attach(offer, plan.nbytes, plan.dtype)
            logger.info("shard %d at %s shares this machine: payloads go through shared memory",
                        self.shard, self.address)
        except SharedMemoryUnavailable as e:
            if required:
                raise DistributedError(f"shard {self.shard} at {self.address}: shared memory "
                                       f"unavailable ({e}); use ps.payload_transport: auto or "
                                       "grpc when servers run on other machines") from e
            logger.info("shard %d at %s is on another machine (%s): payloads go through gRPC",
                        self.shard, self.address, e)

    def close(self) -> None:
        self.channel.close()
