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
- **Compact top-k** (`compression.compact`): a block of n elements keeping k = ceil(ratio·n)
  is a 9-byte header, k LEB128 varints of the index gaps and k fp16 values. Top-k of a
  gradient keeps positions spread about at random, so a gap minus one is about geometric
  with p = k/n and takes `1 + Σ_{b=7,14,21,28} (1 - p)^(2^b)` bytes on average: at 1%,
  1.28 bytes, 3.28 bytes per kept element with its value (`compact_topk_nbytes`; the
  plain top-k block takes 8).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from disttrain.compression import Compressor
from disttrain.compression.powersgd import TensorPlan, plan_bucket
from disttrain.compression.schemes import topk_count
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


# Compact top-k's block: kind byte, count and index-byte length (`compression.compact`).
COMPACT_HEADER_BYTES = 9
_VARINT_STEPS = (7, 14, 21, 28)  # a gap of at least 2**b takes one more byte


def compact_gap_bytes(keep_share: float) -> float:
    """Mean bytes of one varint index gap where a share `keep_share` of the positions is
    kept, spread at random."""
    if keep_share >= 1:
        return 1.0
    return 1.0 + sum(math.exp((1 << b) * math.log1p(-keep_share)) for b in _VARINT_STEPS)


def compact_topk_nbytes(numel: int, ratio: float, itemsize: int = 4) -> float:
    """Expected bytes of a compact top-k block of `numel` elements at `ratio`: never more
    than the dense values and a byte (the encoder keeps fewer then, `compact.encode_block`)."""
    if numel == 0:
        return 0.0
    k = topk_count(numel, ratio)
    sparse = COMPACT_HEADER_BYTES + k * (2 + compact_gap_bytes(k / numel))
    return min(sparse, 1 + numel * itemsize)
