"""What a shard's optimizer does besides the optimizer's own step: the learning-rate
schedule by the shard's count of updates, clipping of the aggregated gradient, and weight
decay on the weights only, on one flat parameter that holds slices of many tensors.

- Schedule: the shard counts the updates it applied (saved in its checkpoint). In sync
  mode one update is one step; in async and SSP every push is an update, and
  `num_workers` of them make one step (`schedule`'s module docstring says why). The
  shard tells each worker the rate its push was (or will be) applied with
  (`rate_of`), which the worker logs as `optim/learning_rate`.
- Parameter groups: the flat shard is one tensor, so weight decay cannot come from torch's
  groups. The optimizer runs without it, and the shard decays the ranges that hold weights
  of two or more dimensions itself, exactly as torch does inside the step: added to the
  gradient (sgd, adam) or the parameter shrunk by `1 - lr x decay` (adamw), before it.
- Clipping by global norm, on the weighted sum of the pushed gradients (the gradient that
  is applied). The global norm spans every shard, and shards do not talk to each other,
  so a shard of `n_s` of the model's `n` elements clips its slice to `clip_grad_norm x
  sqrt(n_s / n)`: the applied gradient's global norm never exceeds `clip_grad_norm`
  (the squared budgets add up to its square), and with one shard this is exactly global
  clipping. With several, a shard whose slice is under its budget is left alone even when
  another is clipped, so the result can differ from global clipping; use one server for
  runs whose exactness against one process matters.
- Local updates (`training.sync_every`, `training.local_updates`): the workers take their
  inner steps themselves and push pseudo-gradients (round-start parameters minus their
  own), so the shard's optimizer is the OUTER one: sgd, with `outer_momentum` as heavy
  ball or `nesterov`, at `outer_learning_rate`, constant, without decay or clipping (the
  inner optimizer on each worker applies those). One update is one round.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from disttrain.config import TrainingConfig
from disttrain.strategies.ps.wire.sharding import ShardPlan
from disttrain.training.engine import build_optimizer
from disttrain.training.schedule import INITIAL_LR, LRSchedule, ScheduleState, remember_initial_rates


def decayed_ranges(plan: ShardPlan) -> list[tuple[int, int]]:
    """The shard-local [start, end) ranges of `plan` that hold weights of two or more
    dimensions (adjacent ranges merged): the elements weight decay applies to."""
    ranges: list[tuple[int, int]] = []
    offset = 0
    for piece in plan.slices:
        if len(piece.shape) >= 2:
            if ranges and ranges[-1][1] == offset:
                ranges[-1] = (ranges[-1][0], offset + piece.length)
            else:
                ranges.append((offset, offset + piece.length))
        offset += piece.length
    return ranges


def outer_training(training: TrainingConfig) -> TrainingConfig:
    """The settings a shard's optimizer takes under local updates: the outer optimizer
    (optimizer "nesterov" stands for sgd with nesterov momentum), at a constant rate,
    without weight decay or clipping."""
    return replace(training, optimizer=training.outer_optimizer, learning_rate=training.outer_learning_rate,
                   momentum=training.outer_momentum, weight_decay=0.0, clip_grad_norm=0.0,
                   lr_schedule="constant", warmup_steps=0)


class ShardOptimizer:
    """The optimizer of one shard's flat parameter, with its schedule, decay and clipping.

    Args:
        param: the shard's flat parameter.
        plan: the slices the shard holds (which of them decay).
        training: optimizer, rate, schedule, `weight_decay`, `clip_grad_norm`.
        model_numel: elements of the whole model (each shard's share of the clipping norm).
        updates_per_step: updates that make one schedule step (1 in sync mode, the number
            of workers in async and SSP).
    """

    def __init__(self, param: torch.nn.Parameter, plan: ShardPlan, training: TrainingConfig,
                 model_numel: int, updates_per_step: int = 1):
        self.param = param
        if training.local_update_mode:
            training = outer_training(training)
        # One flat tensor per shard: the fused kernels update it in one pass. It is one-
        # dimensional, so `build_optimizer` gives it no weight decay: `prepare` does that.
        if training.optimizer == "nesterov":  # the outer optimizer of local updates
            self.optimizer = remember_initial_rates(torch.optim.SGD(
                [param], lr=training.learning_rate, momentum=training.momentum, nesterov=True, fused=True))
        else:
            self.optimizer = build_optimizer([param], training, fused=True)
        self.schedule = LRSchedule.of(training)
        self.weight_decay = training.weight_decay
        self.decoupled = training.optimizer == "adamw"
        self.decayed = decayed_ranges(plan) if self.weight_decay else []
        self.clip_norm = training.clip_grad_norm * math.sqrt(plan.numel / model_numel)
        self.updates_per_step = updates_per_step
        self.state = ScheduleState()  # num_steps counts updates applied here
        self.num_clipped = 0

    @property
    def changes_gradient(self) -> bool:
        """Whether `prepare` writes into the gradient (so it must be the shard's own copy)."""
        return self.clip_norm > 0 or (bool(self.decayed) and not self.decoupled)

    @property
    def step(self) -> int:
        """The schedule's step of the next update."""
        return self.state.num_steps // self.updates_per_step

    def set_rate(self) -> None:
        """Set the rate of the next update by the schedule. Call before the update."""
        self.schedule.apply(self.optimizer, self.step)

    def rate_of(self, applied: bool) -> float:
        """The learning rate of the update just applied (`applied`), or of the next one:
        what `set_rate` set, or will set."""
        group = self.optimizer.param_groups[0]
        if applied or self.schedule.constant:
            return float(group["lr"])
        return float(group[INITIAL_LR] * self.schedule.factor(self.step))

    def prepare(self, gradient: torch.Tensor) -> None:
        """Clip `gradient` (the aggregated one, the shard's own buffer when
        `changes_gradient`) and apply weight decay, as the optimizer's step would. Call
        right before `optimizer.step()`, inside the guarded region (it may change the
        parameter)."""
        if self.clip_norm > 0:
            norm = float(torch.linalg.vector_norm(gradient))
            # torch's clip_grad_norm_: the same coefficient, so one shard equals one process.
            coefficient = self.clip_norm / (norm + 1e-6)
            if coefficient < 1.0:
                gradient.mul_(coefficient)
                self.num_clipped += 1
        if not self.decayed:
            return
        with torch.no_grad():
            if self.decoupled:
                shrink = 1.0 - float(self.optimizer.param_groups[0]["lr"]) * self.weight_decay
                for start, end in self.decayed:
                    self.param[start:end].mul_(shrink)
            else:
                for start, end in self.decayed:
                    gradient[start:end].add_(self.param[start:end], alpha=self.weight_decay)

    def applied(self) -> None:
        """Count an update that was applied (the schedule moves on)."""
        self.state.num_steps += 1

    def bounds_group(self) -> dict[str, Any]:
        """The optimizer's group as the update's magnitude bounds must see it: with the
        weight decay the shard applies itself."""
        return {**self.optimizer.param_groups[0], "weight_decay": self.weight_decay}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state (tensors copied) and the schedule's count of updates."""
        optimizer_state = self.optimizer.state_dict()
        optimizer_state["state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                                    for k, s in optimizer_state["state"].items()}
        return {"optimizer": optimizer_state, "schedule": self.state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`'s pieces (the shard checks that both are there)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.load_state_dict(state["schedule"])
