"""Figures summed or maximised over ranks: test-set evaluation and run totals.

Each rank evaluates its own slice of the test set; the sums of loss, correct answers and
samples are all-reduced, so the accuracy is that of the whole test set, counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disttrain.data import BatchedDataset
from disttrain.training.engine import EvalResult, eval_slice, evaluate


def all_reduce_values(values: list[float], device: torch.device,
                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """All-reduce a few numbers (float64, exact for counts below 2**53). A collective."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's floating-point buffers (BatchNorm's running statistics) on every rank, as
    DDP does before each forward; nothing for a model without them. A collective."""
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])
    dist.broadcast(flat, src=0)
    offset = 0
    for buffer in buffers:
        buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
        offset += buffer.numel()


def evaluate_sharded(model: nn.Module, dataset: BatchedDataset, batch_size: int, rank: int,
                     world_size: int, device: torch.device) -> EvalResult:
    """Loss and accuracy on the whole of `dataset`, each rank evaluating a slice. A collective.

    Every rank first takes rank 0's buffers: each rank's forward of the last step updated
    its own running statistics with its own batch (DDP hands out rank 0's only at the next
    forward), so a rank evaluating with its own would score another model than the one the
    run saves, rank 0's. Training is unchanged by it: the next forward takes rank 0's anyway.

    Args:
        model: the plain module (not the DDP wrapper, whose forward may communicate).
    """
    broadcast_buffers(model)
    local = evaluate(model, dataset, batch_size, indices=eval_slice(len(dataset), world_size, rank),
                     device=device)
    return EvalResult.from_sums(all_reduce_values(local.sums(), device))
