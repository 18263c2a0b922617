"""The worker's calls to one shard: deadlines and retries on every call, and payload
bytes through gRPC messages or the shard's shared-memory segments.

Every RPC carries a deadline (`ps.rpc_timeout_s`); transient failures (server not up
yet or restarting, deadline passed) are retried with exponential backoff and jitter.
Retrying a push is safe: the server acknowledges a (worker, step) it already took as a
duplicate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import tenacity
import torch

from disttrain.core.errors import DistributedError
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
            frames = list(wire.gradient_frames(header_copy, plan, data))
            sent[0] += nbytes
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
