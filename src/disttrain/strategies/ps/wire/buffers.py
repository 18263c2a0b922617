"""A shard's model buffers on the wire: one float64 `TensorProto` beside the payload.

Buffers (BatchNorm's running statistics and batch counter) are small next to the
parameters, so they travel inline in the header of every push (the change the worker's
step made to them) and of every parameter answer (their values at that version), raw
little-endian bytes like every tensor here, never a pickle. float64 holds every buffer
dtype the plan keeps exactly (integers up to 2**53), so one tensor carries them all.
"""

from __future__ import annotations

import math

import torch

from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.wire.codec import decode_tensor, tensor_bytes
from disttrain.strategies.ps.wire.sharding import ShardPlan

WIRE_DTYPE = "float64"


def buffer_proto(values: torch.Tensor) -> tensor_pb2.TensorProto:
    """The wire form of a shard's flat buffer values (or changes): float64, 1-D."""
    values = values.detach().reshape(-1).to(torch.float64)
    return tensor_pb2.TensorProto(data=bytes(tensor_bytes(values)), shape=[values.numel()], dtype=WIRE_DTYPE)


def read_buffers(message, plan: ShardPlan, what: str) -> torch.Tensor | None:
    """The flat float64 buffers a message (GradientMessage or ParameterMessage) carries
    for `plan` (a copy), or None when the shard holds no buffers.

    Args:
        what: how to name the message in errors ("push", "answer of shard 1").
    Raises:
        ValueError: buffers missing where the shard holds some, present where it holds
            none, or not of the plan's length, dtype or finite values.
    """
    present = message.HasField("buffers")
    if not plan.buffers:
        if present:
            raise ValueError(f"{what} carries buffers, but shard {plan.shard} holds none; start servers "
                             "and workers with the same model")
        return None
    if not present:
        raise ValueError(f"{what} carries no buffers, but shard {plan.shard} holds "
                         f"{len(plan.buffers)} ({', '.join(b.name for b in plan.buffers)})")
    proto = message.buffers
    if proto.dtype != WIRE_DTYPE or list(proto.shape) != [plan.buffer_numel]:
        raise ValueError(f"{what}: buffers are {proto.dtype or 'unset'} {list(proto.shape)}, expected "
                         f"{WIRE_DTYPE} [{plan.buffer_numel}]")
    values = decode_tensor(proto.data, WIRE_DTYPE, (plan.buffer_numel,)).clone()
    if values.numel() and not math.isfinite(float(values.abs().max())):
        raise ValueError(f"{what}: buffers hold NaN or infinite values")
    return values


def initial_buffers(model: torch.nn.Module, plan: ShardPlan) -> torch.Tensor:
    """The flat float64 values of `plan`'s buffers in `model` (a new tensor)."""
    state = model.state_dict()
    if not plan.buffers:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([state[b.name].detach().reshape(-1).to(torch.float64) for b in plan.buffers])
