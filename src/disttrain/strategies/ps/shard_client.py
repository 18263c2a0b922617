"""The worker's payload calls to one shard: pushes, pulls and steps (a push and the
parameters it leads to in one round trip), their bytes through gRPC messages or the
shard's shared-memory segments. Deadlines, retries and registration are the channel's
(`shard_channel`)."""

from __future__ import annotations

import logging

import grpc
import torch

from disttrain.core.errors import DistributedError
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import wire
from disttrain.strategies.ps.codec import Frame, Payload, copy_chunks, decode_chunks, decode_tensor
from disttrain.strategies.ps.shard_channel import ReplyLost, RetryPolicy, ShardChannel, describe
from disttrain.strategies.ps.sharding import ShardPlan
from disttrain.strategies.ps.step_stream import StepStream

logger = logging.getLogger(__name__)

__all__ = ["RetryPolicy", "ShardClient", "StepUnsupported"]

ROLLED_BACK = pb.PushReply.Outcome.Value("ROLLED_BACK")


class StepUnsupported(Exception):
    """The server predates Step: push and pull instead."""


class ShardClient(ShardChannel):
    """Push, pull and step on one shard's server (see `ShardChannel` for the rest)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream = StepStream(lambda requests: self._calls["Step"](requests, wait_for_ready=True))
        self.step_supported = True  # until the server answers Step with UNIMPLEMENTED

    def _outgoing(self, data: memoryview) -> tuple[memoryview, int]:
        """The bytes a push's message carries (none when they went into shared memory,
        copied there now) and the payload's size."""
        data = memoryview(data).cast("B")
        if self.segments is None:
            return data, data.nbytes
        source, target = decode_tensor(data, torch.uint8), self.segments.gradient_tensor.view(torch.uint8)
        if source.data_ptr() != target.data_ptr():  # else: computed in the segment already
            target[:data.nbytes].copy_(source)
        return memoryview(b""), data.nbytes

    def _frames(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview) -> list[bytes]:
        """The messages of one attempt of a push: `header` stamped with how its bytes go,
        the server incarnation and the session as they are now."""
        header_copy = pb.GradientMessage()
        header_copy.CopyFrom(header)
        header_copy.shared_memory = self.segments is not None
        header_copy.incarnation, header_copy.session = self.incarnation, self.session
        return list(wire.gradient_frames(header_copy, plan, data))

    def _lose_reply(self, step: int) -> None:
        if self.drop_replies > 0:
            self.drop_replies -= 1
            raise ReplyLost(f"the reply of step {step}'s push was dropped (injected fault)")

    def push(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview) -> tuple[pb.PushReply, int]:
        """Send one gradient (raw values, or a compressed payload when `header.compressed`);
        returns the reply and the payload bytes sent (a retry sends them again; the
        messages' framing, some hundred bytes, is not counted)."""
        data, nbytes = self._outgoing(data)
        sent = [0]

        def attempt():
            frames = self._frames(header, plan, data)
            sent[0] += nbytes
            if len(frames) == 1:
                reply = self._calls["PushGradients"](frames[0], timeout=self.policy.timeout_s,
                                                     wait_for_ready=True)
            else:
                reply = self._calls["SendGradients"](iter(frames), timeout=self.policy.timeout_s,
                                                     wait_for_ready=True)
            self._lose_reply(header.step)
            return reply

        reply = self._retry("SendGradients", attempt)
        if reply.incarnation not in (0, self.incarnation):
            self.rejoin(reply.incarnation)  # the server restarted: it has read nothing of this push
        return reply, sent[0]

    def step(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview, into: torch.Tensor
             ) -> tuple[pb.PushReply, int | None, int]:
        """Push one gradient and take the parameters it leads to into `into`, in one round
        trip on this shard's Step stream (see `StepStream`).

        Returns:
            (the push's reply, the version now in `into` or None when the reply brought no
            parameters (ROLLED_BACK), payload bytes sent).
        Raises:
            StepUnsupported: the server has no Step (it stays so for this client).
        """
        data, nbytes = self._outgoing(data)
        sent = [0]

        def attempt():
            (message,) = self._frames(header, plan, data)
            sent[0] += nbytes
            try:
                answer = self.stream.exchange(message, self.policy.timeout_s)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.step_supported = False
                    raise StepUnsupported(describe(e)) from e
                raise
            self._lose_reply(header.step)
            return answer

        answer = self._retry("Step", attempt)
        reply = answer.header.push
        if reply.incarnation not in (0, self.incarnation):
            self.rejoin(reply.incarnation)
        if reply.outcome == ROLLED_BACK:
            return reply, None, sent[0]
        return reply, self._land(answer, plan, 0, into), sent[0]

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
        if payload.header.incarnation not in (0, self.incarnation):
            logger.warning("shard %d at %s restarted at version %d (this worker waited for %d)",
                           plan.shard, self.address, payload.header.version, min_version)
            self.rejoin(payload.header.incarnation)
            return self.pull(worker_id, plan, 0, into)
        return self._land(payload, plan, min_version, into), plan.nbytes

    def _land(self, answer: Payload | Frame, plan: ShardPlan, min_version: int, into: torch.Tensor) -> int:
        """Copy the parameters of an answer into `into` (from shared memory when they went
        there); their version.

        Raises:
            DistributedError: not the version, size or transport asked for.
        """
        segments = self.segments
        chunks = answer.chunks if isinstance(answer, Payload) else [answer.data]
        nbytes, expected = sum(chunk.nbytes for chunk in chunks), 0 if segments is not None else plan.nbytes
        if answer.header.version < min_version or nbytes != expected \
                or answer.header.shared_memory != (segments is not None):
            raise DistributedError(f"shard {plan.shard} answered version {answer.header.version} "
                                   f"with {nbytes} bytes; expected version >= {min_version} "
                                   f"and {expected} bytes")
        if segments is not None:
            if into.data_ptr() != segments.parameter_tensor.data_ptr():  # else: landed in place
                into.copy_(segments.parameter_tensor)
        else:
            copy_chunks(decode_chunks(chunks, plan.dtype), into)
        return answer.header.version

    def close(self) -> None:
        self.stream.shutdown()
        super().close()
