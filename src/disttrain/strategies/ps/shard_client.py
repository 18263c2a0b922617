"""The worker's calls to one shard: deadlines and retries on every call, and payload
bytes through gRPC messages or the shard's shared-memory segments.

Every RPC carries a deadline (`ps.rpc_timeout_s`); transient failures (server not up
yet or restarting, deadline passed) are retried with exponential backoff and jitter.
Retrying a push is safe: the server acknowledges a (worker, step) it already took as a
duplicate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import tenacity
import torch

from disttrain.core.auth import with_token
from disttrain.core.errors import DistributedError
from disttrain.core.tls import TlsFiles
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import wire
from disttrain.strategies.ps.codec import Payload, copy_chunks, decode_chunks, decode_tensor
from disttrain.strategies.ps.sharding import ShardPlan
from disttrain.strategies.ps.shared_memory import SegmentPair, SharedMemoryUnavailable

logger = logging.getLogger(__name__)

TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


@dataclass(frozen=True)
class RetryPolicy:
    """Deadline of each attempt, and how often and how patiently to retry. The default
    rides out a server's restart (tens of seconds of UNAVAILABLE)."""

    timeout_s: float = 60.0
    max_attempts: int = 30
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 3.0


class ReplyLost(ConnectionError):
    """An injected fault: the server took the push but its reply never came back."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, ReplyLost) or isinstance(error, grpc.RpcError) and error.code() in TRANSIENT


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


class ShardClient:
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
            stop=tenacity.stop_after_attempt(policy.max_attempts), before_sleep=log_retry, reraise=True)
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

    def push(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview) -> tuple[pb.PushReply, int]:
        """Send one gradient (raw values, or a compressed payload when `header.compressed`);
        returns the reply and the payload bytes sent (a retry sends them again; the
        messages' framing, some hundred bytes, is not counted)."""
        data = memoryview(data).cast("B")
        nbytes, sent = data.nbytes, [0]
        if self.segments is not None:
            self.segments.gradient_tensor.view(torch.uint8)[:nbytes].copy_(decode_tensor(data, torch.uint8))
            data = memoryview(b"")

        def attempt():
            header_copy = pb.GradientMessage()
            header_copy.CopyFrom(header)
            header_copy.shared_memory = self.segments is not None
            header_copy.incarnation, header_copy.session = self.incarnation, self.session
            frames = list(wire.gradient_frames(header_copy, plan, data))
            sent[0] += nbytes
            if len(frames) == 1:
                reply = self._calls["PushGradients"](frames[0], timeout=self.policy.timeout_s,
                                                     wait_for_ready=True)
            else:
                reply = self._calls["SendGradients"](iter(frames), timeout=self.policy.timeout_s,
                                                     wait_for_ready=True)
            if self.drop_replies > 0:
                self.drop_replies -= 1
                raise ReplyLost(f"the reply of step {header.step}'s push was dropped (injected fault)")
            return reply

        reply = self._retry("SendGradients", attempt)
        if reply.incarnation not in (0, self.incarnation):
            self.rejoin(reply.incarnation)  # the server restarted: it has read nothing of this push
        return reply, sent[0]

    def pull(self, worker_id: str, plan: ShardPlan, min_version: int, into: torch.Tensor
             ) -> tuple[int, int]:
        """Copy the shard's parameters, once at `min_version`, into `into` (its flat slice).

        Returns:
            (version, payload bytes received).
        """
        segments = self.segments
        request = pb.ParameterRequest(worker_id=worker_id, min_version=min_version, shard=plan.shard,
                                      shared_memory=segments is not None)

        one_message = segments is not None or wire.fits_one_message(plan.nbytes)

        def attempt():
            request.incarnation, request.session = self.incarnation, self.session
            if one_message:
                frame = self._calls["FetchParameters"](request, timeout=self.policy.timeout_s,
                                                       wait_for_ready=True)
                return Payload(frame.header, frame.meta, [frame.data])
            stream = self._calls["GetParameters"](request, timeout=self.policy.timeout_s,
                                                  wait_for_ready=True)
            return wire.collect_payload(iter(stream), plan.nbytes)

        payload = self._retry("GetParameters", attempt)
        expected = 0 if segments is not None else plan.nbytes
        if payload.header.incarnation not in (0, self.incarnation):
            logger.warning("shard %d at %s restarted at version %d (this worker waited for %d)",
                           plan.shard, self.address, payload.header.version, min_version)
            self.rejoin(payload.header.incarnation)
            return self.pull(worker_id, plan, 0, into)
        if payload.header.version < min_version or payload.nbytes != expected \
                or payload.header.shared_memory != (segments is not None):
            raise DistributedError(f"shard {plan.shard} answered version {payload.header.version} "
                                   f"with {payload.nbytes} bytes; expected version >= {min_version} "
                                   f"and {expected} bytes")
        if segments is not None:
            into.copy_(segments.parameter_tensor)
        else:
            copy_chunks(decode_chunks(payload.chunks, plan.dtype), into)
        return payload.header.version, plan.nbytes

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
