"""The arithmetic of a two-phase int8 all-reduce, whose bytes per rank stay flat as ranks are
added (the collective of ZeRO++'s qgZ and of torchft's and prime's quantized all-reduce).

An all-gather of every rank's int8 payload makes each rank receive (n - 1) payloads: at 8
ranks as many bytes as a dense float32 ring all-reduce, and more beyond. Two phases instead:

1. each rank cuts its (error-corrected) gradient into n chunks, quantizes each with a scale
   of its own, and sends chunk j to rank j (an all-to-all): it receives (n - 1) chunks of
   P / n elements;
2. rank j adds the n chunks j it holds in float32, in rank order, divides by n, quantizes
   that mean again and sends it to everyone (an all-gather): it receives (n - 1) chunks.

Each rank receives about 2 P (n - 1) / n bytes plus 8 (n - 1) bytes of scales, flat in n,
against (n - 1) P for the all-gather; the two are equal at 2 ranks. Every rank dequantizes
the same bytes of phase 2, so every rank holds the same average bit for bit. Both roundings
are fed back by the hook: phase 1's by each rank, phase 2's by the chunk's owner.

Pure tensor functions: the hook in `ddp_hooks` runs the collectives.
"""

from __future__ import annotations

import math

import torch

LEVELS = 127  # symmetric int8: -127..127, so a chunk's scale is its largest magnitude / 127


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per chunk: the gradient padded to a multiple of the ranks."""
    return max(1, math.ceil(numel / world_size))


def quantize_chunks(flat: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`flat` (float) cut into `world_size` chunks, zero-padded, each quantized to int8 with
    its own float32 scale. Returns (int8 of shape (world_size, chunk), scales (world_size,))."""
    size = chunk_size(flat.numel(), world_size)
    padded = torch.zeros(world_size * size, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    return quantize_rows(padded.view(world_size, size))


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `rows` to int8 with a scale of its own (a row of zeros: scale 1)."""
    scales = rows.abs().amax(dim=1) / LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(rows / scales[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes, scales.float()


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 rows of int8 `codes` times their `scales`."""
    return codes.to(torch.float32) * scales[:, None]


def mean_of_chunks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of the chunks one rank received (row r from rank r), added in
    rank order so every owner's arithmetic is the same."""
    values = dequantize_rows(codes, scales)
    total = torch.zeros_like(values[0])
    for row in values:  # in rank order, not a tree: the same sum on every run
        total += row
    return total / len(values)


def received_bytes(numel: int, world_size: int) -> int:
    """Bytes each rank receives in both phases: (n - 1) chunks of int8 and (n - 1) float32
    scales in each."""
    others = world_size - 1
    return 2 * others * (chunk_size(numel, world_size) + 4)
