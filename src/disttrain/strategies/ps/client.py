"""The worker's side of the wire: one channel per shard, deadlines and retries on every
call, and pushes and pulls to all shards at once.

Every RPC carries a deadline (`ps.rpc_timeout_s`); transient failures (server not up
yet or restarting, deadline passed) are retried with exponential backoff and jitter.
Retrying a push is safe: the server acknowledges a (worker, step) it already took as a
duplicate. Calls to several shards run concurrently on a small thread pool.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc
import tenacity
import torch

from disttrain.config.schema import PAYLOAD_TRANSPORTS
from disttrain.core.errors import DistributedError
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import shared_memory, wire
from disttrain.strategies.ps.codec import Payload, copy_chunks, decode_chunks, decode_tensor, tensor_bytes
from disttrain.strategies.ps.sharding import ShardPlan
from disttrain.strategies.ps.shared_memory import SegmentPair, SharedMemoryUnavailable

logger = logging.getLogger(__name__)

TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


@dataclass(frozen=True)
class RetryPolicy:
    """Deadline of each attempt, and how often and how patiently to retry."""

    timeout_s: float = 60.0
    max_attempts: int = 6
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0


def is_transient(error: BaseException) -> bool:
    return isinstance(error, grpc.RpcError) and error.code() in TRANSIENT


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


class ShardClient:
    """Calls to one shard's server at `address`. Payload bytes travel in the gRPC
    messages, or through shared memory once `segments` are attached (same machine)."""

    def __init__(self, address: str, shard: int, policy: RetryPolicy):
        self.address = address
        self.shard = shard
        self.policy = policy
        self.segments: SegmentPair | None = None
        self.channel = grpc.insecure_channel(address, options=wire.CHANNEL_OPTIONS)
        self._calls = {}
        for name, (kind, request_type, response_type) in wire.METHODS.items():
            serialize = wire.identity if request_type is None else request_type.SerializeToString
            deserialize = wire.read_parameters if response_type is None else response_type.FromString
            self._calls[name] = getattr(self.channel, kind)(
                wire.method_path(name), request_serializer=serialize, response_deserializer=deserialize)

    def _retry(self, what: str, fn: Callable[[], object]):
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
        try:
            return retrying(fn)
        except grpc.RpcError as e:
            raise DistributedError(f"{what} on shard {self.shard} at {self.address} failed: "
                                   f"{describe(e)}") from e

    def unary(self, name: str, request, timeout_s: float | None = None):
        timeout = self.policy.timeout_s if timeout_s is None else timeout_s
        return self._retry(name, lambda: self._calls[name](request, timeout=timeout, wait_for_ready=True))

    def push(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview) -> tuple[pb.PushReply, int]:
        """Send one gradient; returns the reply and the payload bytes sent (a retry sends
        them again; the messages' framing, some hundred bytes, is not counted)."""
        sent = [0]
        if self.segments is not None:
            self.segments.gradient_tensor.copy_(decode_tensor(data, plan.dtype))
            data = memoryview(b"")

        def attempt():
            header_copy = pb.GradientMessage()
            header_copy.CopyFrom(header)
            header_copy.shared_memory = self.segments is not None
            frames = list(wire.gradient_frames(header_copy, plan, data))
            sent[0] += plan.nbytes
            if len(frames) == 1:
                return self._calls["PushGradients"](frames[0], timeout=self.policy.timeout_s,
                                                    wait_for_ready=True)
            return self._calls["SendGradients"](iter(frames), timeout=self.policy.timeout_s,
                                                wait_for_ready=True)

        return self._retry("SendGradients", attempt), sent[0]

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
            if one_message:
                frame = self._calls["FetchParameters"](request, timeout=self.policy.timeout_s,
                                                       wait_for_ready=True)
                return Payload(frame.header, frame.meta, [frame.data])
            stream = self._calls["GetParameters"](request, timeout=self.policy.timeout_s,
                                                  wait_for_ready=True)
            return wire.collect_payload(iter(stream), plan.nbytes)

        payload = self._retry("GetParameters", attempt)
        expected = 0 if segments is not None else plan.nbytes
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


class PSClient:
    """All shards of a run, with their plans; calls fan out concurrently.

    Args:
        addresses: "host:port" of each shard's server, in shard order.
        plans: the worker's own shard plans (checked against the servers' at register).
    """

    def __init__(self, addresses: list[str], plans: list[ShardPlan], policy: RetryPolicy,
                 transport: str = "auto"):
        if len(addresses) != len(plans):
            raise ValueError(f"{len(addresses)} server addresses for {len(plans)} shards")
        if transport not in PAYLOAD_TRANSPORTS:
            raise ValueError(f"payload transport {transport!r} is not one of {', '.join(PAYLOAD_TRANSPORTS)}")
        self.plans = plans
        self.transport = transport
        self.shards = [ShardClient(a, i, policy) for i, a in enumerate(addresses)]
        self._pool = ThreadPoolExecutor(max(2 * len(addresses), 2), thread_name_prefix="ps-client")
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def gather(self, calls: list[Callable[[], object]]) -> list:
        """Run `calls` concurrently (the first on this thread); raise the first failure at once."""
        futures = [self._pool.submit(call) for call in calls[1:]]
        try:
            first = calls[0]()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
        return [first] + [f.result() for f in futures]

    def submit(self, call: Callable[[], object]):
        return self._pool.submit(call)

    def register(self, worker_id: str, requested_rank: int = -1) -> pb.WorkerAssignment:
        """Register with shard 0 (which assigns the rank), then with the others under it.

        Raises:
            DistributedError: a server's layout differs from this worker's model, or the
                servers disagree on the run's shape.
        """
        wants_memory = self.transport != "grpc" and shared_memory.available()
        if self.transport == "shared_memory" and not wants_memory:
            raise DistributedError("ps.payload_transport is shared_memory, but this machine has "
                                   f"no writable {shared_memory.SEGMENT_DIR}; use auto or grpc")
        request = pb.RegisterRequest(worker_id=worker_id, requested_rank=requested_rank,
                                     hostname=socket.gethostname(), pid=os.getpid(),
                                     shared_memory=wants_memory)
        first = self.shards[0].unary("RegisterWorker", request)
        request.requested_rank = first.rank
        rest = self.gather([lambda s=s: s.unary("RegisterWorker", request) for s in self.shards[1:]]) \
            if len(self.shards) > 1 else []
        for shard, assignment in zip(self.shards, [first, *rest], strict=True):
            plan = self.plans[shard.shard]
            if assignment.num_shards != len(self.shards) or assignment.shard != shard.shard:
                raise DistributedError(f"server {shard.address} holds shard {assignment.shard}/"
                                       f"{assignment.num_shards}, but it was given as shard "
                                       f"{shard.shard}/{len(self.shards)}; list servers in shard order")
            if wire.plan_layout(assignment.layout) != plan.slices or assignment.dtype != plan.dtype:
                raise DistributedError(f"server {shard.address} holds a different model than this "
                                       "worker; start servers and workers with the same config")
            shape = (assignment.world_size, assignment.aggregation_mode, assignment.staleness)
            if shape != (first.world_size, first.aggregation_mode, first.staleness):
                raise DistributedError("the servers were started with different configs")
            if assignment.HasField("shared_memory"):
                shard.attach(assignment.shared_memory, plan, self.transport == "shared_memory")
            elif self.transport == "shared_memory":
                raise DistributedError(f"server {shard.address} offered no shared memory; use "
                                       "ps.payload_transport: auto or grpc")
        return first

    def pull(self, worker_id: str, flat: torch.Tensor, min_versions: list[int]) -> list[int]:
        """Copy every shard's parameters (each once at its min version) into `flat`."""
        results = self.gather([
            lambda s=s, p=p, v=v: s.pull(worker_id, p, v, flat[p.offset:p.offset + p.numel])
            for s, p, v in zip(self.shards, self.plans, min_versions, strict=True)])
        self._count(received=sum(r[1] for r in results))
        return [r[0] for r in results]

    def push(self, headers: list[pb.GradientMessage], grads: torch.Tensor, shards: list[int]
             ) -> list[pb.PushReply]:
        """Push `grads` (the flat gradient) to `shards`, each with its header."""
        data = tensor_bytes(grads)
        size = grads.element_size()

        def send(header: pb.GradientMessage, shard: int) -> tuple[pb.PushReply, int]:
            plan = self.plans[shard]
            start, end = plan.offset * size, (plan.offset + plan.numel) * size
            return self.shards[shard].push(header, plan, data[start:end])

        results = self.gather([lambda h=h, s=s: send(h, s) for h, s in zip(headers, shards, strict=True)])
        self._count(sent=sum(r[1] for r in results))
        return [r[0] for r in results]

    def barrier(self, worker_id: str, name: str, values: list[float] = ()) -> list[list[float]]:
        """Meet every worker at barrier `name` (on shard 0); every worker's values, in rank
        order. Waits as long as the slowest worker takes, retrying each deadline."""
        reply = self.shards[0].unary("Barrier", pb.BarrierRequest(worker_id=worker_id, name=name,
                                                                  values=list(values)))
        width = len(reply.values) // max(reply.world_size, 1)
        return [list(reply.values[r * width:(r + 1) * width]) for r in range(reply.world_size)]

    def call_all(self, name: str, request, timeout_s: float | None = None) -> list:
        return self.gather([lambda s=s: s.unary(name, request, timeout_s) for s in self.shards])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for shard in self.shards:
            shard.close()
