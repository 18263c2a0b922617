"""Deep Gradient Compression's training rules (Lin et al., ICLR 2018) for top-k: the
arithmetic alone, which `Compressor` applies per segment whatever carries the payload.

- local gradient clipping: each segment's gradient is clipped to the norm
  `clip_norm * num_workers ** -0.5` before it is accumulated (the paper's scaling: N
  workers' clipped gradients sum to about the global threshold);
- momentum correction: a local velocity `u = m * u + g` is accumulated, `v += u`, and
  top-k of `v` is sent (error feedback keeps `v - sent`), so what is sent carries the
  momentum a dense SGD with momentum would have applied; the receiving optimizer must
  then apply none (the config check refuses a momentum there);
- momentum factor masking: the kept entries are zeroed in `u` as well as in `v`, so a
  stale velocity does not keep pushing coordinates that were just sent;
- sparsity warm-up: the share kept falls exponentially from `warmup_ratio` to `ratio`
  over `warmup_steps` payloads, so early, fast-changing gradients are not starved.

Pure tensor functions and a frozen settings value: no state lives here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from disttrain.config import CompressionConfig


@dataclass(frozen=True)
class DgcRules:
    """Which of DGC's rules a top-k compressor applies (the defaults apply none)."""

    momentum: float = 0.0  # momentum correction's factor m; 0: off
    masking: bool = True  # momentum factor masking (with momentum correction only)
    clip_norm: float = 0.0  # each segment's gradient norm bound on this worker; 0: no clipping
    warmup_steps: int = 0  # payloads over which the share kept falls to `ratio`; 0: none
    warmup_ratio: float = 0.25  # the share kept at the first payload of the warm-up

    def __post_init__(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum correction's factor {self.momentum} must be in [0, 1)")
        if self.clip_norm < 0 or self.warmup_steps < 0:
            raise ValueError("the clipping norm and the warm-up steps must be >= 0")
        if not 0 < self.warmup_ratio <= 1:
            raise ValueError(f"the warm-up ratio {self.warmup_ratio} must be in (0, 1]")

    @classmethod
    def of(cls, section: CompressionConfig, num_workers: int = 1) -> DgcRules | None:
        """The rules a `compression` section asks for (None: none of them), for a run of
        `num_workers` workers or ranks (local clipping's N^-1/2 scaling)."""
        rules = cls(momentum=section.momentum_correction, masking=section.momentum_masking,
                    clip_norm=section.local_clip_norm / math.sqrt(max(1, num_workers)),
                    warmup_steps=section.warmup_steps, warmup_ratio=section.warmup_ratio)
        return rules if rules.active else None

    @property
    def active(self) -> bool:
        return bool(self.momentum or self.clip_norm or self.warmup_steps)

    def ratio_at(self, step: int, ratio: float) -> float:
        """The share kept at a segment's `step`-th payload (0-based): exponential from
        `warmup_ratio` down to `ratio` over `warmup_steps`, then `ratio`."""
        if step >= self.warmup_steps or self.warmup_ratio <= ratio:
            return ratio
        return self.warmup_ratio * (ratio / self.warmup_ratio) ** (step / self.warmup_steps)


def clip_parts(gradient: torch.Tensor, sizes: list[int], max_norm: float) -> torch.Tensor:
    """`gradient` (1-D, the parts' total length) with each part scaled down to at most
    `max_norm` (a new tensor; parts within the bound are unchanged)."""
    parts = []
    for part in gradient.split(sizes):
        norm = float(torch.linalg.vector_norm(part.float()))
        parts.append(part * (max_norm / norm) if norm > max_norm else part)
    return torch.cat(parts) if parts else gradient.clone()


def accumulate(gradient: torch.Tensor, velocity: torch.Tensor | None, residual: torch.Tensor | None,
               momentum: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Momentum correction's step: `u = m * u + g` (None without momentum correction) and
    what is sparsified, `v + u` (`v`: the residual, what earlier payloads left out).
    Returns (accumulated, new velocity). `velocity` and `residual` are the caller's own
    copies and are written in place (1.2M-value gradients: no allocation per step)."""
    if momentum:
        velocity = gradient.clone() if velocity is None else velocity.mul_(momentum).add_(gradient)
        gradient = velocity
    return (gradient if residual is None else residual.add_(gradient)), velocity
