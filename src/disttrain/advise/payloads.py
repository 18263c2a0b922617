"""Bytes a compressed step puts on the wire, from the model's parameter shapes alone, by
the rules the transports follow:

- **PowerSGD at rank r** (DDP): each gradient viewed as a `(shape[0], -1)` matrix of
  rows x cols is sent as its factors P (rows x r') and Q (cols x r'), r' = min(rows,
  cols, r), where PyTorch's hook finds that worth it (`(rows + cols)·r'·2 < rows·cols`);
  every other gradient is all-reduced as it is (`compression.powersgd.plan_bucket`). The
  grouping into buckets changes nothing: the rule is per gradient.
- **Pull compression** (parameter server, sync): each of S shards answers with its
  change in the push format over its slices (`plan_shards` cuts the flat parameters at
  `floor(k·total/S)`); every `dense_every`-th version the shard sends its parameters
  dense, so a step pulls `((D-1)·Σ_s change_s + G) / D` on average.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from disttrain.compression import Compressor
from disttrain.compression.powersgd import TensorPlan, plan_bucket
from disttrain.strategies.ps.wire.payloads import shard_segments
from disttrain.strategies.ps.wire.sharding import plan_shards

Shapes = tuple[tuple[int, ...], ...]
# PyTorch's `PowerSGDState` default: compress a matrix only where it halves its size.
MIN_COMPRESSION_RATE = 2.0


def powersgd_plan(shapes: Shapes, rank: int,
                  min_compression_rate: float = MIN_COMPRESSION_RATE) -> list[TensorPlan]:
    """What PowerSGD does with each gradient: its matrix and rank (0: sent as it is)."""
    return plan_bucket(tuple((str(i), tuple(shape)) for i, shape in enumerate(shapes)), rank,
                       min_compression_rate)


def powersgd_numel(shapes: Shapes, rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE) -> int:
    """Elements one step's PowerSGD all-reduces carry: P and Q of each compressed matrix,
    the rest as it is."""
    return sum(t.sent_numel for t in powersgd_plan(shapes, rank, min_compression_rate))


def powersgd_payload_bytes(shapes: Shapes, rank: int, itemsize: int = 4) -> int:
    return powersgd_numel(shapes, rank) * itemsize


class _Shaped(nn.Module):
    """Parameters of the given shapes on the meta device: sizes without memory."""

    def __init__(self, shapes: Shapes):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.empty(shape, device="meta")) for shape in shapes])


@lru_cache(maxsize=256)
def pull_change_bytes(shapes: Shapes, num_shards: int, scheme: str, ratio: float, itemsize: int = 4) -> int:
    """Bytes of one version's compressed change over all `num_shards` shards together
    (what one worker pulls at a version that is not dense)."""
    plans = plan_shards(_Shaped(shapes), num_shards)
    compressor = Compressor(scheme, ratio, error_feedback=False)
    return sum(compressor.payload_nbytes(shard_segments(plan), itemsize) for plan in plans)


def pull_bytes_per_step(shapes: Shapes, num_shards: int, scheme: str, ratio: float, dense_every: int,
                        itemsize: int = 4) -> float:
    """Bytes one worker pulls per step on average: compressed changes, and every
    `dense_every`-th version the parameters dense ("none": always dense)."""
    dense = sum(math.prod(shape) for shape in shapes) * itemsize
    if scheme == "none":
        return float(dense)
    change = pull_change_bytes(tuple(shapes), num_shards, scheme, ratio, itemsize)
    return ((dense_every - 1) * change + dense) / dense_every
