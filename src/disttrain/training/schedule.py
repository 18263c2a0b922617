"""Learning-rate schedules by step: constant, step decay, and linear warm-up followed by
cosine or linear decay to a floor.

A schedule is a pure function of the number of optimizer steps already taken: the rate
of step `n` (0-based) is `initial_lr x factor(n)`, `initial_lr` being each parameter
group's configured rate (after DDP's `lr_scaling`). Nothing else is kept, so a run's
schedule state is that one count, saved in every checkpoint beside the optimizer, and a
resumed run continues the same curve exactly.

What a step is:
- baseline and DDP: one optimizer step of the process (a DDP step all-reduces once,
  whatever its micro-batches);
- parameter server, sync: one applied update of the shard (one global batch);
- parameter server, async and SSP: each push is applied on its own, and `num_workers`
  pushes make one step (one global batch's worth of gradients), so a schedule given in
  steps spans the same data in every mode.

The curve, with warm-up W, decay end D and floor m (as a fraction of the rate):
- steps n < W: linear warm-up, factor (n + 1) / W (the first step is not wasted at 0);
- constant: 1; step: gamma ** (n // step_size) (counted from step 0, like StepLR);
- cosine: m + (1 - m) (1 + cos(pi p)) / 2, linear: 1 - (1 - m) p, with p = (n - W) / (D - W)
  clamped to [0, 1]: the rate stays at the floor after step D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.config import TrainingConfig

SCHEDULES = ("constant", "step", "cosine", "linear")
INITIAL_LR = "initial_lr"  # each parameter group's scheduled-from rate (the name torch's schedulers use)


@dataclass(frozen=True)
class LRSchedule:
    """The multiplier of the learning rate at each step.

    Args:
        kind: constant, step, cosine or linear.
        warmup_steps: steps of linear warm-up (0: none).
        decay_steps: cosine and linear: the step at which the decay reaches the floor.
        min_factor: cosine and linear: the floor, as a fraction of the initial rate.
        step_size, gamma: step: multiply by gamma every step_size steps.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_factor: float = 0.0
    step_size: int = 1
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"training.lr_schedule: unknown schedule {self.kind!r}; use one of "
                             + ", ".join(SCHEDULES))
        if self.kind in ("cosine", "linear") and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"training.lr_decay_steps: {self.decay_steps} must be greater than "
                             f"training.warmup_steps ({self.warmup_steps}) for the {self.kind} schedule")

    @classmethod
    def of(cls, training: TrainingConfig) -> LRSchedule:
        """The schedule of the `training` section."""
        return cls(training.lr_schedule, training.warmup_steps, training.lr_decay_steps,
                   training.lr_min / training.learning_rate, training.lr_step_size, training.lr_gamma)

    @property
    def constant(self) -> bool:
        """Whether every step has the initial rate (today's behaviour, nothing to set)."""
        return self.kind == "constant" and self.warmup_steps == 0

    def factor(self, step: int) -> float:
        """The multiplier of the initial rate for step `step` (0-based: steps taken before it)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return self.gamma ** (step // self.step_size)
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        if self.kind == "cosine":
            return self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - self.min_factor) * progress

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Set every parameter group's rate for step `step`. Call before `optimizer.step()`.

        Raises:
            KeyError: a group without `initial_lr` (not made by `engine.build_optimizer`).
        """
        if self.constant:
            return
        factor = self.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = group[INITIAL_LR] * factor


def remember_initial_rates(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Record each group's configured rate as the one schedules scale (kept in the
    optimizer's state_dict, so a resumed run scales the same rate). Returns `optimizer`."""
    for group in optimizer.param_groups:
        group.setdefault(INITIAL_LR, group["lr"])
    return optimizer


@dataclass
class ScheduleState:
    """The count a schedule runs on (steps or updates taken), as checkpoints keep it."""

    num_steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
