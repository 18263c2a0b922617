"""Checks every incoming push against the shard's layout before anything changes.

Each failed check raises `InvalidPush` with a one-line reason naming the field, what was
expected and what arrived; the servicer answers INVALID_ARGUMENT with it. Checks that
need the shard's membership (registered worker, versions) live in the aggregation rules.
"""

from __future__ import annotations

import torch

from disttrain.strategies.ps.codec import Payload, all_finite, decode_chunks, to_dtype
from disttrain.strategies.ps.sharding import ShardPlan, TensorSlice
from disttrain.strategies.ps.wire import plan_layout


class InvalidPush(ValueError):
    """A malformed push: wrong layout, shape, dtype, length or values. Nothing changed."""


def check_header(payload: Payload, plan: ShardPlan) -> None:
    """Check a push's header and payload metadata (not yet its bytes).

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
    if header.compressed or header.compression_type:
        raise InvalidPush(f"compressed payloads ({header.compression_type or 'unnamed'}) are not "
                          "accepted by this server; send raw values")
    _check_layout(plan_layout(header.layout), plan)
    if meta.dtype != plan.dtype:
        raise InvalidPush(f"payload dtype is {meta.dtype or 'unset'!r}, expected {plan.dtype!r}")
    if list(meta.shape) != [plan.numel]:
        raise InvalidPush(f"payload shape is {list(meta.shape)}, expected the flat [{plan.numel}]")


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


def decode_payload(payload: Payload, plan: ShardPlan) -> list[torch.Tensor]:
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
    if not all(all_finite(chunk) for chunk in chunks):
        raise InvalidPush("payload holds NaN or infinite values; the gradient is discarded")
    return chunks
