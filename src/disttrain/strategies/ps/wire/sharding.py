"""How a model's parameters are split across S parameter servers, and the flat buffers.

All parameters, concatenated in `named_parameters()` order, form one flat vector. Shard
`s` owns one contiguous range of it, cut at `s * total_bytes / S`, so shards differ by at
most one element and a large tensor is split into slices across shards (SimpleCNN's first
linear layer holds 95% of its parameters: per-tensor placement could not balance it).
The same plan is computed by every server and worker from the model alone; a worker
checks its plan against each server's layout at registration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.strategies.ps.wire.codec import dtype_name, to_dtype


@dataclass(frozen=True)
class TensorSlice:
    """Elements [start, start + length) of the flattened tensor `name` of shape `shape`."""

    name: str
    shape: tuple[int, ...]
    start: int
    length: int


@dataclass(frozen=True)
class ShardPlan:
    """What shard `shard` of `num_shards` owns: `slices`, which are elements
    [offset, offset + numel) of the model's flat vector."""

    shard: int
    num_shards: int
    slices: tuple[TensorSlice, ...]
    offset: int
    numel: int
    dtype: str

    @property
    def names(self) -> set[str]:
        return {s.name for s in self.slices}

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=to_dtype(self.dtype)).element_size()


def model_tensors(model: nn.Module) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, numel) of every parameter, in the model's order.

    Raises:
        ValueError: parameters of different dtypes (they could not share a flat buffer).
    """
    params = list(model.named_parameters())
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the model's parameters mix dtypes {sorted(map(str, dtypes))}; the "
                         "parameter server needs one dtype")
    return [(name, tuple(p.shape), p.numel()) for name, p in params]


def plan_shards(model: nn.Module, num_shards: int) -> list[ShardPlan]:
    """Partition `model`'s parameters into `num_shards` contiguous, byte-balanced shards.

    Raises:
        ValueError: more shards than parameters, or parameters of mixed dtypes.
    """
    tensors = model_tensors(model)
    dtype = dtype_name(next(model.parameters()).dtype)
    total = sum(numel for _, _, numel in tensors)
    if not 1 <= num_shards <= total:
        raise ValueError(f"cannot split {total} parameters into {num_shards} shards")
    bounds = [math.floor(k * total / num_shards) for k in range(num_shards + 1)]
    plans = []
    for shard in range(num_shards):
        lo, hi = bounds[shard], bounds[shard + 1]
        slices, cursor = [], 0
        for name, shape, numel in tensors:
            start, end = max(lo, cursor), min(hi, cursor + numel)
            if start < end:
                slices.append(TensorSlice(name, shape, start - cursor, end - start))
            cursor += numel
        plans.append(ShardPlan(shard, num_shards, tuple(slices), lo, hi - lo, dtype))
    return plans


def flat_parameters(model: nn.Module, flat: torch.Tensor | None = None, grads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Move `model`'s parameters and gradients into two flat buffers and return them.

    Afterwards each parameter is a view of the parameter buffer and its `.grad` a view of
    the gradient buffer, so a backward pass leaves every gradient in place for sending,
    and received parameters land with one copy per shard. Zero the gradient buffer
    in place (never set `.grad` to None) before each backward.

    Args:
        flat, grads: 1-D buffers of the model's size to use (shared memory, say), the
            parameters' current values copied in and the gradients zeroed; None: new ones.
    Returns:
        (flat parameters, flat gradients), 1-D, in `named_parameters()` order.
    """
    params = list(model.parameters())
    values = torch.cat([p.detach().reshape(-1) for p in params])
    flat = values if flat is None else flat.copy_(values)
    grads = torch.zeros_like(flat) if grads is None else grads.zero_()
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        p.grad = grads[offset:offset + n].view_as(p)
        offset += n
    return flat, grads


def state_dict_from_flat(model: nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's state_dict with its parameters taken from `flat` (copies, not views)."""
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    offset = 0
    for name, p in model.named_parameters():
        state[name] = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return state
