"""Mixed precision, the same in every strategy (`training.precision`): bf16 autocast on CPU
or CUDA, or fp16 autocast with a GradScaler on CUDA.

`plan_precision` is the pure decision (tested without a GPU); `Precision` carries it out
in `engine.forward_backward`: the forward pass under autocast, the loss and backward
outside it in float32 (as PyTorch advises), and fp16's loss scaled so small gradients do
not flush to zero. The scaler's unscaling and skipped steps belong to the optimizer step
(`stepping.OptimizerStep`). Parameters, gradients, optimizer state, what crosses the
wire or the all-reduce, and evaluation stay float32: autocast only changes the dtype the
forward pass computes in.

fp16 runs on CUDA only: loss scaling needs the process that steps the optimizer to
unscale, so it is refused under the parameter server (whose workers push gradients the
servers apply) as well as on CPUs, where bf16 is the half precision autocast offers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.core.errors import ConfigError


@dataclass(frozen=True)
class PrecisionPlan:
    """What the step does: autocast dtype (None: full precision) and whether to scale the loss."""

    mode: str
    autocast_dtype: torch.dtype | None = None
    use_grad_scaler: bool = False

    @property
    def enabled(self) -> bool:
        return self.autocast_dtype is not None


def plan_precision(mode: str, device_type: str, bf16_supported: bool = True,
                   loss_scaling: bool = True) -> PrecisionPlan:
    """Choose the mixed-precision plan for `training.precision` on a device.

    Args:
        mode: none, bf16 or fp16.
        device_type: the process's device type (`cuda` or `cpu`).
        bf16_supported: on CUDA, whether the GPU computes in bf16 (`torch.cuda.is_bf16_supported()`).
        loss_scaling: whether the strategy can scale the loss (not the parameter server's workers).
    Raises:
        ConfigError: fp16 on a CPU or without loss scaling, bf16 on a GPU without it, or an unknown mode.
    """
    if mode == "none":
        return PrecisionPlan("none")
    if mode not in ("bf16", "fp16"):
        raise ConfigError(f"training.precision: unknown mode {mode!r}; use none, bf16 or fp16")
    if mode == "bf16":
        if device_type == "cuda" and not bf16_supported:
            raise ConfigError("training.precision: this GPU has no bf16 support; use fp16")
        return PrecisionPlan("bf16", torch.bfloat16, use_grad_scaler=False)
    if not loss_scaling:
        raise ConfigError("training.precision: fp16 needs loss scaling, which the parameter server's "
                          "workers cannot do (the servers apply their gradients); use bf16")
    if device_type != "cuda":
        raise ConfigError(f"training.precision: fp16 runs on CUDA GPUs only and this run uses the "
                          f"{device_type}; use bf16 (autocast on the CPU too) or none")
    return PrecisionPlan("fp16", torch.float16, use_grad_scaler=True)


class Precision:
    """Carries out a `PrecisionPlan` on `device` inside `engine.forward_backward`.

    Call order per optimizer step: `engine.forward_backward(..., precision=self)` once per
    micro-batch, then the optimizer step with `scaler` (`stepping.OptimizerStep`).
    """

    def __init__(self, plan: PrecisionPlan, device: torch.device | str = "cpu"):
        self.plan = plan
        self.device = torch.device(device)
        self.scaler = torch.amp.GradScaler(self.device.type) if plan.use_grad_scaler else None

    def autocast(self) -> AbstractContextManager:
        """The forward pass's context: autocast to the plan's dtype, or nothing."""
        if not self.plan.enabled:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.plan.autocast_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: fp16's scaled loss, else the loss itself."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

