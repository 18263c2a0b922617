"""Compressed gradients on the parameter-server wire.

A shard's gradient is compressed on its own, cut into one segment per tensor slice the
shard holds (named `name[start:end]`), so each model tensor gets its own top-k or int8
range and a tiny one goes dense. The worker keeps the error-feedback residuals; a push a
server refuses as too stale keeps the old residual, since the gradient is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from disttrain.compression import Compressor, Counters, Encoded, InvalidPayload, Segment
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire.codec import to_dtype
from disttrain.strategies.ps.wire.sharding import ShardPlan

STALE = pb.PushReply.Outcome.Value("STALE")


def shard_segments(plan: ShardPlan) -> list[Segment]:
    """The segments of a shard's flat gradient: one per tensor slice, in order."""
    return [(f"{s.name}[{s.start}:{s.start + s.length}]", s.length) for s in plan.slices]


class GradientEncoder:
    """A worker's compressor, applied shard by shard to its flat gradient."""

    def __init__(self, compressor: Compressor, plans: Sequence[ShardPlan]):
        self.compressor = compressor
        self.plans = list(plans)
        self.segments = [shard_segments(plan) for plan in self.plans]
        self._reported = Counters()

    @property
    def scheme(self) -> str:
        return self.compressor.scheme

    def encode(self, grads: torch.Tensor, shards: Sequence[int]) -> list[Encoded]:
        """The payload of each shard in `shards`, from the flat gradient `grads`."""
        out = []
        for shard in shards:
            plan = self.plans[shard]
            out.append(self.compressor.encode(grads[plan.offset:plan.offset + plan.numel],
                                              self.segments[shard]))
        return out

    def commit(self, encoded: Sequence[Encoded], replies: Sequence[pb.PushReply]) -> None:
        """Keep the residuals of every payload a server took (not those refused as stale)."""
        for payload, reply in zip(encoded, replies, strict=True):
            if reply.outcome != STALE:
                self.compressor.commit(payload)

    def scalars(self) -> dict[str, float]:
        """Bytes before and after compression, and dense segments, since the last call
        (the time is the step timer's: the exchange times encoding as a phase)."""
        now = replace(self.compressor.counters)
        step, self._reported = now.since(self._reported), now
        return {key: value for key, value in step.scalars().items() if not key.startswith("time/")}

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)
        self._reported = replace(self.compressor.counters)


class ParameterChanges:
    """Pull compression's payload: the change of a shard's broadcast copy between two
    versions, written as a push of `scheme` over the shard's segments (see
    `server/broadcast.py`). The shard and every worker add a change through `add`, the
    one way it is added, so their copies stay equal to the bit.

    Args:
        plan: the shard.
        scheme: topk, quantization, fp16 or bf16.
        ratio: topk's share of the shard's elements a change carries.
    """

    def __init__(self, plan: ShardPlan, scheme: str, ratio: float):
        # Stateless: the shard carries what a change left out in its copy's distance.
        self.compressor = Compressor(scheme, ratio, error_feedback=False)
        self.segments = shard_segments(plan)
        self.numel = plan.numel
        self.itemsize = torch.empty(0, dtype=to_dtype(plan.dtype)).element_size()

    @property
    def scheme(self) -> str:
        return self.compressor.scheme

    @property
    def nbytes(self) -> int:
        """Bytes of one change's payload."""
        return self.compressor.payload_nbytes(self.segments, self.itemsize)

    def encode(self, delta: torch.Tensor) -> bytes:
        """The payload of `delta` (1-D, the shard's length)."""
        return self.compressor.encode(delta, self.segments).data

    def add(self, held: torch.Tensor, data: bytes | memoryview, scratch: torch.Tensor) -> None:
        """Add the change `data` decodes to into `held`, decoding into `scratch` (the same
        length and dtype) first.

        Raises:
            InvalidPayload: the bytes do not decode; `held` is unchanged.
        """
        self.compressor.decode(data, self.segments, scratch)
        held.add_(scratch)

    def add_all(self, held: torch.Tensor, data: bytes | memoryview, count: int,
                scratch: torch.Tensor) -> None:
        """Add the `count` changes `data` holds one after another (each `nbytes` long, the
        oldest first) into `held`, in their order, as the shard added them to its copy.

        Raises:
            InvalidPayload: `data` is not `count` changes, or one does not decode; `held`
                is unchanged.
        """
        data = memoryview(data).cast("B")
        if count < 1 or data.nbytes != count * self.nbytes:
            raise InvalidPayload(f"{data.nbytes} bytes are not {count} {self.scheme} changes of "
                                 f"{self.nbytes} bytes each")
        if count == 1:
            self.add(held, data, scratch)
            return
        result = held.clone()  # so that a change that does not decode leaves `held` as it was
        for i in range(count):
            self.add(result, data[i * self.nbytes:(i + 1) * self.nbytes], scratch)
        held.copy_(result)
