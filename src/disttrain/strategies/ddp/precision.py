"""Mixed precision for DDP ranks on CUDA: bf16 autocast, or fp16 autocast with a GradScaler.

`plan_precision` is the pure decision (tested without a GPU); `Precision` carries it out
in the step: forward and loss under autocast, backward outside it (as PyTorch advises),
the fp16 loss scaled so small gradients do not flush to zero, and the optimizer step
skipped by the scaler when a scaled gradient overflowed. With `none` the step is the
shared `engine.forward_backward`, unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.core.errors import ConfigError
from disttrain.training.engine import StepResult, count_correct, forward_backward, task_loss


@dataclass(frozen=True)
class PrecisionPlan:
    """What the step does: autocast dtype (None: full precision) and whether to scale the loss."""

    mode: str
    autocast_dtype: torch.dtype | None = None
    use_grad_scaler: bool = False

    @property
    def enabled(self) -> bool:
        return self.autocast_dtype is not None


def plan_precision(mode: str, device_type: str, bf16_supported: bool = False) -> PrecisionPlan:
    """Choose the mixed-precision plan for `ddp.mixed_precision` on a device.

    Args:
        mode: none, bf16 or fp16.
        device_type: the rank's device type (`cuda` or `cpu`).
        bf16_supported: whether that GPU computes in bf16 (`torch.cuda.is_bf16_supported()`).
    Raises:
        ConfigError: mixed precision on a CPU rank, bf16 on a GPU without it, or an unknown mode.
    """
    if mode == "none":
        return PrecisionPlan("none")
    if mode not in ("bf16", "fp16"):
        raise ConfigError(f"ddp.mixed_precision: unknown mode {mode!r}; use none, bf16 or fp16")
    if device_type != "cuda":
        raise ConfigError(f"ddp.mixed_precision: {mode} runs on CUDA GPUs only and this run's ranks "
                          f"use the {device_type}; set ddp.mixed_precision=none or run on GPUs")
    if mode == "bf16":
        if not bf16_supported:
            raise ConfigError("ddp.mixed_precision: this GPU has no bf16 support; use fp16")
        return PrecisionPlan("bf16", torch.bfloat16, use_grad_scaler=False)
    return PrecisionPlan("fp16", torch.float16, use_grad_scaler=True)


class Precision:
    """Runs forward/backward and the optimizer step under a `PrecisionPlan`.

    Call order per optimizer step: `forward_backward` once per micro-batch, then `step`.
    """

    def __init__(self, plan: PrecisionPlan, device: torch.device):
        self.plan = plan
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if plan.use_grad_scaler else None

    def autocast(self):
        if not self.plan.enabled:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.plan.autocast_dtype)

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_scale: float = 1.0) -> StepResult:
        """Gradients of `loss_scale` x the mean loss accumulate into `.grad` (scaled for fp16)."""
        if not self.plan.enabled:
            return forward_backward(model, inputs, targets, loss_scale)
        model.train()
        with self.autocast():
            logits = model(inputs)
            loss = task_loss(logits, targets)
        weighted = loss * loss_scale
        (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
        with torch.no_grad():
            correct = count_correct(logits, targets)
        return StepResult(float(loss.detach()), correct, len(targets))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step; with fp16, unscale first and skip a step whose gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
