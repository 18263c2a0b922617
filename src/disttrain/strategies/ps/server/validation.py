"""Checks every incoming push against the shard's layout before anything changes, and
turns its bytes into the gradient (decompressing a compressed payload).

Each failed check raises `InvalidPush` with a one-line reason naming the field, what was
expected and what arrived; the servicer answers INVALID_ARGUMENT with it. Checks that
need the shard's membership (registered worker, versions) live in the aggregation rules.
"""

from __future__ import annotations

import math

import torch

from disttrain.compression import Compressor, InvalidPayload
from disttrain.compression.schemes import magnitude_bound
from disttrain.config import CompressionConfig
from disttrain.strategies.ps.wire.codec import Payload, decode_chunks, to_dtype
from disttrain.strategies.ps.wire.payloads import shard_segments
from disttrain.strategies.ps.wire.service import plan_layout, read_buffers
from disttrain.strategies.ps.wire.sharding import ShardPlan, TensorSlice


class InvalidPush(ValueError):
    """A malformed push: wrong layout, shape, dtype, length or values. Nothing changed."""


class Gradient(list):
    """A decoded gradient: its 1-D chunks in order, `bound`, the largest magnitude in
    them (the update uses it to tell whether a step could overflow), and `buffers`, the
    change the worker's step made to the shard's buffers (float64; None: it holds none)."""

    def __init__(self, chunks: list[torch.Tensor], bound: float, buffers: torch.Tensor | None = None):
        super().__init__(chunks)
        self.bound = bound
        self.buffers = buffers


def bounded(chunks: list[torch.Tensor]) -> Gradient:
    """`chunks` with their bound. Raises InvalidPush when a value is NaN or infinite."""
    bound = max((magnitude_bound(chunk) for chunk in chunks), default=0.0)
    if not math.isfinite(bound):
        raise InvalidPush("payload holds NaN or infinite values; the gradient is discarded")
    return Gradient(chunks, bound)


def check_header(payload: Payload, plan: ShardPlan, scheme: str | None = None,
                 max_samples: int | None = None) -> None:
    """Check a push's header and payload metadata (not yet its bytes).

    Args:
        scheme: the compression scheme of the run (None: the run sends raw values). A
            payload may still come uncompressed in a compressing run.
        max_samples: the most samples one push may stand for (the run's batch size): a
            larger count would outweigh every other worker's gradient in the average.
    Raises:
        InvalidPush: naming the first problem found.
    """
    header, meta = payload.header, payload.meta
    if not header.worker_id:
        raise InvalidPush("worker_id is empty")
    if header.shard != plan.shard:
        raise InvalidPush(f"push for shard {header.shard} reached shard {plan.shard}")
    if header.step < 1 or header.base_version < 0 or header.num_samples < 1:
        raise InvalidPush(f"step ({header.step}) and num_samples ({header.num_samples}) must be >= 1 "
                          f"and base_version ({header.base_version}) >= 0")
    if max_samples is not None and header.num_samples > max_samples:
        raise InvalidPush(f"num_samples ({header.num_samples}) exceeds the run's batch size "
                          f"({max_samples}); one push stands for one batch at most")
    _check_compression(header, scheme)
    _check_layout(plan_layout(header.layout), plan)
    if meta.dtype != plan.dtype:
        raise InvalidPush(f"payload dtype is {meta.dtype or 'unset'!r}, expected {plan.dtype!r}")
    if list(meta.shape) != [plan.numel]:
        raise InvalidPush(f"payload shape is {list(meta.shape)}, expected the flat [{plan.numel}]")


def _check_compression(header, scheme: str | None) -> None:
    if not header.compressed:
        if header.compression_type:
            raise InvalidPush(f"compression_type is {header.compression_type!r} on an uncompressed "
                              "payload; set compressed, or leave the type empty")
    elif scheme is None:
        raise InvalidPush(f"the payload is compressed ({header.compression_type or 'unnamed'}) and "
                          "this run sends raw values; start servers and workers with the same "
                          "compression settings")
    elif header.compression_type != scheme:
        raise InvalidPush(f"the payload is compressed with {header.compression_type or 'no scheme'!r} "
                          f"and this run uses {scheme!r}")


def _check_layout(layout: tuple[TensorSlice, ...], plan: ShardPlan) -> None:
    expected = {s.name: s for s in plan.slices}
    for got in layout:
        want = expected.get(got.name)
        if want is None:
            raise InvalidPush(f"unknown tensor name {got.name!r}: shard {plan.shard} holds "
                              f"{', '.join(expected)}")
        if got.shape != want.shape:
            raise InvalidPush(f"{got.name}: shape {list(got.shape)} does not match the model's "
                              f"{list(want.shape)}")
        if (got.start, got.length) != (want.start, want.length):
            raise InvalidPush(f"{got.name}: slice [{got.start}, +{got.length}) is not this shard's "
                              f"[{want.start}, +{want.length})")
    if [s.name for s in layout] != [s.name for s in plan.slices]:
        raise InvalidPush(f"layout lists {[s.name for s in layout]}, expected "
                          f"{[s.name for s in plan.slices]}")


def decode_payload(payload: Payload, plan: ShardPlan) -> Gradient:
    """The flat gradient of a push whose header passed `check_header`, as 1-D chunks
    (views of the received bytes, in order).

    Raises:
        InvalidPush: truncated or overlong bytes, or non-finite values.
    """
    itemsize = torch.empty((), dtype=to_dtype(plan.dtype)).element_size()
    expected = plan.numel * itemsize
    if payload.nbytes != expected:
        raise InvalidPush(f"payload has {payload.nbytes} bytes, expected {expected} "
                          f"({plan.numel} x {plan.dtype}); truncated or padded")
    try:
        chunks = decode_chunks(payload.chunks, plan.dtype)
    except ValueError as e:
        raise InvalidPush(f"payload chunks split an element: {e}") from e
    return bounded(chunks)


class PushDecoder:
    """A shard's checks and decoding of pushes, for the run's compression settings and
    batch size (`max_samples`: the most samples one push may stand for; None: no bound)."""

    def __init__(self, plan: ShardPlan, compression: CompressionConfig, max_samples: int | None = None):
        self.plan = plan
        self.max_samples = max_samples
        self.compressor = None
        if compression.enabled and compression.type != "powersgd":
            self.compressor = Compressor.from_config(compression, seed=0)  # decodes only
        self.segments = shard_segments(plan)
        itemsize = torch.empty((), dtype=to_dtype(plan.dtype)).element_size()
        self.compressed_nbytes = None if self.compressor is None else \
            self.compressor.payload_nbytes(self.segments, itemsize)

    @property
    def scheme(self) -> str | None:
        return None if self.compressor is None else self.compressor.scheme

    def check_header(self, payload: Payload) -> None:
        check_header(payload, self.plan, self.scheme, self.max_samples)

    def payload_nbytes(self, payload: Payload) -> int:
        """How many bytes the push's payload has (of a shared-memory segment: how many to read)."""
        return self.compressed_nbytes if payload.header.compressed else self.plan.nbytes

    def decode(self, payload: Payload) -> Gradient:
        """The flat gradient of a push whose header passed `check_header`, as 1-D chunks
        (raw payloads: views of the received bytes; compressed ones: one new tensor).

        Buffers (the change the step made to the shard's buffers) always travel raw.

        Raises:
            InvalidPush: the bytes do not decode (lengths, counts, indices, scales, values),
                or the buffers do not fit the shard's.
        """
        try:
            buffers = read_buffers(payload.header, self.plan, "push")
        except ValueError as e:
            raise InvalidPush(str(e)) from e
        if not payload.header.compressed:
            gradient = decode_payload(payload, self.plan)
        else:
            data = payload.chunks[0] if len(payload.chunks) == 1 else b"".join(payload.chunks)
            out = torch.empty(self.plan.numel, dtype=to_dtype(self.plan.dtype))
            try:
                # From shared memory: read as the most bytes a payload may take.
                self.compressor.decode(data, self.segments, out, padded=payload.header.shared_memory)
            except InvalidPayload as e:
                raise InvalidPush(f"{self.scheme} payload: {e}") from e
            gradient = bounded([out])
        gradient.buffers = buffers
        return gradient
