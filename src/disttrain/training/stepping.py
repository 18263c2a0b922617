"""The optimizer step of a process that holds the whole model (baseline, DDP rank): the
learning rate by schedule, clipping by global norm, fp16's loss scaling, and the count
of steps the schedule runs on, saved with the optimizer in every checkpoint.

Call order per step: zero the gradients, forward/backward (and, in DDP, the all-reduce
that ends the last backward), then `step()`: unscale (fp16), clip, set the rate, step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from disttrain.config import TrainingConfig
from disttrain.training.engine import clip_gradients
from disttrain.training.schedule import LRSchedule, ScheduleState

logger = logging.getLogger(__name__)


class OptimizerStep:
    """Applies the gradient in `.grad` with `optimizer`, by `training`'s schedule and clipping.

    Args:
        optimizer: made by `engine.build_optimizer` (its groups know their initial rate).
        training: the schedule and `clip_grad_norm` (0: no clipping).
        scaler: fp16's GradScaler (None: no loss scaling).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, training: TrainingConfig,
                 scaler: torch.amp.GradScaler | None = None):
        self.optimizer = optimizer
        self.schedule = LRSchedule.of(training)
        self.clip_grad_norm = training.clip_grad_norm
        self.scaler = scaler
        self.state = ScheduleState()
        self.last_grad_norm: float | None = None  # before clipping; None when not clipping

    def step(self) -> None:
        """One optimizer step on the gradients in `.grad`; with fp16, a step whose scaled
        gradients overflowed is skipped by the scaler (and still counted by the schedule,
        as torch's schedulers count it)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip_grad_norm > 0:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.last_grad_norm = clip_gradients(params, self.clip_grad_norm)
        self.schedule.apply(self.optimizer, self.state.num_steps)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.state.num_steps += 1

    def scalars(self) -> dict[str, float]:
        """The last step's figures: its learning rate, and with clipping the gradient's
        global norm before it (metric keys `optim/*`)."""
        scalars = {"optim/learning_rate": self.learning_rate}
        if self.last_grad_norm is not None:
            scalars["optim/grad_norm"] = self.last_grad_norm
        return scalars

    @property
    def learning_rate(self) -> float:
        """The rate of the first group at its last step (the configured one before any)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's `optimizer` and `schedule` pieces."""
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`'s pieces from a checkpoint.

        Raises:
            ValueError: the checkpoint holds no schedule, or its optimizer other parameter
                groups than this run's (a checkpoint of an earlier disttrain).
        """
        earlier = "(a checkpoint of an earlier disttrain); start a fresh run in another --checkpoint-dir"
        if "schedule" not in state:
            raise ValueError(f"it holds no learning-rate schedule {earlier}")
        saved, groups = len(state["optimizer"]["param_groups"]), len(self.optimizer.param_groups)
        if saved != groups:
            raise ValueError(f"its optimizer has {saved} parameter group(s), this run's {groups} {earlier}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.load_state_dict(state["schedule"])
