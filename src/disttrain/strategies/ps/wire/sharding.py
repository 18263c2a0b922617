"""How a model's parameters are split across S parameter servers, and the flat buffers.

All trainable parameters, concatenated in `named_parameters()` order, form one flat vector. Shard
`s` owns one contiguous range of it, cut at `s * total_bytes / S`, so shards differ by at
most one element and a large tensor is split into slices across shards (SimpleCNN's first
linear layer holds 95% of its parameters: per-tensor placement could not balance it).
The same plan is computed by every server and worker from the model alone; a worker
checks its plan against each server's layout at registration.

Frozen parameters (`requires_grad=False`) are no part of the flat vector: no server holds,
steps or sends them, and no push carries them, so an optimizer's weight decay or momentum
can never move them, as in baseline and DDP, whose optimizers never hold them. Each
worker keeps the value its model was built with (the same in every process, from the
training seed), and the final model carries it.

A model's buffers (BatchNorm's running statistics and batch counter: every floating-point
or integer tensor of its `state_dict` that is not a parameter) are placed whole, each on
the shard holding the fewest bytes so far (parameters and buffers together), in the
model's order; they travel beside the parameters as float64 (`service.buffer_proto`).
Buffers of other dtypes (bool, complex) stay each worker's own.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.strategies.ps.wire.codec import dtype_name, to_dtype

logger = logging.getLogger(__name__)

# Buffers the server keeps: the wire's dtypes (bool and complex stay each worker's own);
# all convert to float64 exactly (integers up to 2**53).
_BUFFER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.int8, torch.uint8)


@dataclass(frozen=True)
class TensorSlice:
    """Elements [start, start + length) of the flattened tensor `name` of shape `shape`."""

    name: str
    shape: tuple[int, ...]
    start: int
    length: int


@dataclass(frozen=True)
class BufferSlot:
    """The model buffer `name` of shape `shape` and dtype `dtype` (its wire name), held
    whole by one shard."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=to_dtype(self.dtype)).element_size()


@dataclass(frozen=True)
class ShardPlan:
    """What shard `shard` of `num_shards` owns: `slices`, which are elements
    [offset, offset + numel) of the model's flat vector, and whole model `buffers`."""

    shard: int
    num_shards: int
    slices: tuple[TensorSlice, ...]
    offset: int
    numel: int
    dtype: str
    buffers: tuple[BufferSlot, ...] = ()

    @property
    def names(self) -> set[str]:
        return {s.name for s in self.slices}

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=to_dtype(self.dtype)).element_size()

    @property
    def buffer_numel(self) -> int:
        """Elements of this shard's buffers (what their float64 wire tensor holds)."""
        return sum(b.numel for b in self.buffers)

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of this shard's buffers in their own dtypes."""
        return sum(b.nbytes for b in self.buffers)

    def describe(self) -> str:
        """One line: the shard's tensors, slices of split ones, and bytes."""
        split = sum(1 for s in self.slices if s.length != math.prod(s.shape))
        return (f"shard {self.shard}/{self.num_shards}: {len(self.slices)} parameter tensor(s) "
                f"({split} split), {self.numel} elements, {self.nbytes} bytes; "
                f"{len(self.buffers)} buffer(s), {self.buffer_nbytes} bytes")


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter the servers hold: those with requires_grad,
    in the model's order (frozen ones stay each worker's own, see the module's docstring)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def model_tensors(model: nn.Module) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, numel) of every trainable parameter, in the model's order.

    Raises:
        ValueError: no trainable parameters, or parameters of different dtypes (they could
            not share a flat buffer).
    """
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters; the parameter server needs at least one")
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the model's parameters mix dtypes {sorted(map(str, dtypes))}; the "
                         "parameter server needs one dtype")
    return [(name, tuple(p.shape), p.numel()) for name, p in params]


def model_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every buffer the parameter server keeps: those in the model's
    `state_dict` (persistent) of a floating-point or integer dtype, in the model's order.
    Others (bool, complex) stay each worker's own; a warning names them."""
    saved = set(model.state_dict())
    kept, skipped = [], []
    for name, tensor in model.named_buffers():
        if name not in saved:
            continue
        if tensor.dtype not in _BUFFER_DTYPES:
            skipped.append(name)
        else:
            kept.append((name, tensor))
    if skipped:
        logger.warning("buffers %s are neither floating point nor integer: each worker keeps its own",
                       ", ".join(skipped))
    return kept



def plan_shards(model: nn.Module, num_shards: int) -> list[ShardPlan]:
    """Partition `model`'s trainable parameters into `num_shards` contiguous, byte-balanced
    shards, and place its buffers whole on the shards (see the module's docstring).

    Raises:
        ValueError: more shards than parameter elements, or parameters of mixed dtypes.
    """
    tensors = model_tensors(model)
    dtype = dtype_name(trainable_parameters(model)[0][1].dtype)
    total = sum(numel for _, _, numel in tensors)
    if not 1 <= num_shards <= total:
        raise ValueError(f"cannot split {total} parameter elements into {num_shards} shards; use "
                         f"ps.num_servers between 1 and {total}")
    bounds = [math.floor(k * total / num_shards) for k in range(num_shards + 1)]
    itemsize = torch.empty((), dtype=to_dtype(dtype)).element_size()
    loads = [(bounds[s + 1] - bounds[s]) * itemsize for s in range(num_shards)]
    placed: list[list[BufferSlot]] = [[] for _ in range(num_shards)]
    for name, tensor in model_buffers(model):
        slot = BufferSlot(name, tuple(tensor.shape), dtype_name(tensor.dtype))
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        placed[shard].append(slot)
        loads[shard] += slot.nbytes
    plans = []
    for shard in range(num_shards):
        lo, hi = bounds[shard], bounds[shard + 1]
        slices, cursor = [], 0
        for name, shape, numel in tensors:
            start, end = max(lo, cursor), min(hi, cursor + numel)
            if start < end:
                slices.append(TensorSlice(name, shape, start - cursor, end - start))
            cursor += numel
        plans.append(ShardPlan(shard, num_shards, tuple(slices), lo, hi - lo, dtype, tuple(placed[shard])))
    return plans


def log_plan(plans: list[ShardPlan], who: str = "") -> None:
    """Log the shard plan: one line per shard (tensors, elements, bytes, buffers)."""
    total = sum(p.nbytes + p.buffer_nbytes for p in plans)
    logger.info("%sshard plan: %d shard(s), %d bytes in all", f"{who}: " if who else "", len(plans), total)
    for plan in plans:
        logger.info("  %s", plan.describe())


def flat_parameters(model: nn.Module, flat: torch.Tensor | None = None, grads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Move `model`'s trainable parameters and their gradients into two flat buffers and
    return them (frozen parameters stay where they are).

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
    params = [p for _, p in trainable_parameters(model)]
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
    """The model's state_dict with its trainable parameters taken from `flat` (copies, not
    views); frozen ones as the model holds them."""
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    offset = 0
    for name, p in trainable_parameters(model):
        state[name] = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return state


def initial_buffers(model: nn.Module, plan: ShardPlan) -> torch.Tensor:
    """The flat float64 values of `plan`'s buffers in `model` (a new tensor)."""
    state = model.state_dict()
    if not plan.buffers:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([state[b.name].detach().reshape(-1).to(torch.float64) for b in plan.buffers])
