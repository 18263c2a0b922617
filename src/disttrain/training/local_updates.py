"""Local-update training (LocalSGD, DiLoCo): the rounds and the outer optimizer, apart
from any transport.

Each worker takes `sync_every` (H) steps with its own (inner) optimizer, on its own
batches, without communicating: a round. A round ends after H steps, or earlier at an
epoch's last step (every epoch ends with one model, which its evaluation and checkpoint
see). At a round's end each worker's pseudo-gradient, the parameters the round started
from minus its current ones, is averaged over the workers by the transport (DDP's
all-reduce, or the parameter server), and the outer optimizer applies the average to the
round-start parameters, the same on every worker, which all continue from the result:

    delta   = mean over workers (start - params)
    sgd:      buffer = momentum * buffer + delta;  start -= lr * buffer       (buffer = delta at momentum 0)
    nesterov: buffer = momentum * buffer + delta;  start -= lr * (delta + momentum * buffer)

which is torch's SGD (with `nesterov`) stepping on `delta`. With outer sgd at rate 1
without momentum the result is the mean of the workers' parameters (LocalSGD); with H = 1
and an inner SGD that is one synchronous step on the averaged gradient, to rounding.

Call order: `OuterOptimizer(settings, params)` once the parameters hold the run's start
(or `load_state_dict` after a resume); after every inner step `end_of_step(ends_epoch)`;
when it says the round ended: `pseudo_gradient(params)`, average it (transport),
`step(average)`, then `copy_to(params)`.

Streaming DiLoCo (`training.outer_fragments` > 1, `outer_mixing`, `outer_compression`,
`outer_delay`) runs
one `OuterOptimizer` per fragment of the parameters: see `training.fragments`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.config import TrainingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalUpdates:
    """The local-update settings of a run (`training.sync_every`, `training.outer_*`)."""

    sync_every: int
    optimizer: str = "sgd"
    learning_rate: float = 1.0
    momentum: float = 0.0
    # Streaming DiLoCo (see `training.fragments`): fragments, mixing, pseudo-gradient compression.
    num_fragments: int = 1
    mixing: float = 0.0
    compression: str = "none"
    delay: int = 0  # inner steps a fragment's exchange overlaps before it lands (tau)

    @classmethod
    def of(cls, training: TrainingConfig) -> LocalUpdates | None:
        """The run's settings, or None when it averages every step (the mode is off)."""
        if not training.local_update_mode:
            return None
        return cls(training.sync_every, training.outer_optimizer, training.outer_learning_rate,
                   training.outer_momentum, training.outer_fragments, training.outer_mixing,
                   training.outer_compression, training.outer_delay)

    @property
    def streaming(self) -> bool:
        """Whether Streaming DiLoCo's settings are in use (`TrainingConfig.streaming_mode`)."""
        return self.num_fragments > 1 or self.mixing > 0 or self.compression != "none" or self.delay > 0

    def describe(self) -> str:
        """One line for the startup log and the summary."""
        momentum = f", momentum {self.momentum:g}" if self.momentum else ""
        streaming = ""
        if self.streaming:
            streaming = (f"; streaming: {self.num_fragments} fragment(s) at staggered steps, mixing "
                         f"{self.mixing:g}, pseudo-gradients {self.compression}")
            if self.delay:
                streaming += f", each exchange overlapped with the next {self.delay} step(s)"
        return (f"local updates: {self.sync_every} local step(s) per round, then outer {self.optimizer} "
                f"(lr {self.learning_rate:g}{momentum}) on the averaged pseudo-gradient{streaming}")

    def summary_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"sync_every": self.sync_every, "outer_optimizer": self.optimizer,
                                  "outer_learning_rate": self.learning_rate, "outer_momentum": self.momentum}
        if self.streaming:
            fields.update(outer_fragments=self.num_fragments, outer_mixing=self.mixing,
                          outer_compression=self.compression, outer_delay=self.delay)
        return fields


class OuterOptimizer:
    """The round-start parameters, the outer momentum and the place in the round of one
    worker: the same on every worker after each round (every worker steps on the same
    average), so any worker's `state_dict` stands for all.

    The parameters are held flat (one tensor, views per parameter), so the transport
    averages one contiguous pseudo-gradient.

    Args:
        settings: H and the outer optimizer.
        params: the model's trained parameters, in a fixed order (the same on every worker).
    Raises:
        ValueError: the parameters are not all of one dtype and device.
    """

    def __init__(self, settings: LocalUpdates, params: Sequence[torch.Tensor]):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"local updates need the trained parameters in one dtype on one device; "
                             f"the model holds {sorted(str(k) for k in kinds)}")
        self.settings = settings
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        dtype, device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
        total = sum(self.numels)
        self.start = torch.empty(total, dtype=dtype, device=device)
        self.delta = torch.empty_like(self.start)  # the pseudo-gradient, then its average
        self.buffer = torch.zeros_like(self.start) if settings.momentum else None
        self.steps_in_round = 0
        self.rounds = 0  # rounds completed since the run started (a resumed run goes on)
        self.take_start(params)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` cut into one view per parameter, shaped like it."""
        return [part.view(shape) for part, shape in zip(flat.split(self.numels), self.shapes, strict=True)]

    @torch.no_grad()
    def take_start(self, params: Sequence[torch.Tensor]) -> None:
        """Start a round at `params` (the run's start, or parameters loaded from elsewhere)."""
        for view, param in zip(self.views(self.start), params, strict=True):
            view.copy_(param)
        self.steps_in_round = 0

    def end_of_step(self, ends_epoch: bool) -> bool:
        """Count one inner step; True when it ends the round (H steps, or the epoch's last)."""
        self.steps_in_round += 1
        return self.steps_in_round >= self.settings.sync_every or ends_epoch

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This worker's round-start parameters minus its current ones, flat (a buffer the
        transport may average in place and hand back to `step`)."""
        for view, start, param in zip(self.views(self.delta), self.views(self.start), params, strict=True):
            torch.sub(start, param, out=view)
        return self.delta

    @torch.no_grad()
    def step(self, average: torch.Tensor) -> None:
        """Apply the workers' mean pseudo-gradient `average` (flat) to the round-start
        parameters, and open the next round there (then `copy_to` the model)."""
        s = self.settings
        update = average
        if self.buffer is not None:
            self.buffer.mul_(s.momentum).add_(average)
            update = average.add(self.buffer, alpha=s.momentum) if s.optimizer == "nesterov" else self.buffer
        self.start.sub_(update, alpha=s.learning_rate)
        self.steps_in_round = 0
        self.rounds += 1

    @torch.no_grad()
    def copy_to(self, params: Sequence[torch.Tensor]) -> None:
        """Set `params` to the round-start parameters (after `step`, every worker the same)."""
        for param, view in zip(params, self.views(self.start), strict=True):
            param.copy_(view)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and integers only (a `weights_only` checkpoint)."""
        state: dict[str, Any] = {"round_start": self.start.clone(), "steps_in_round": self.steps_in_round,
                                 "rounds": self.rounds}
        if self.buffer is not None:
            state["momentum_buffer"] = self.buffer.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`.

        Raises:
            ValueError: it holds another number of parameters; or the run now has outer
                momentum and the state none (or the reverse).
        """
        start = state["round_start"]
        if start.numel() != self.start.numel():
            raise ValueError(f"its round-start parameters hold {start.numel()} values and this model "
                             f"{self.start.numel()}")
        if (self.buffer is None) != ("momentum_buffer" not in state):
            raise ValueError("it was written with another training.outer_momentum (with or without "
                             "momentum); resume with the run's outer optimizer")
        self.start.copy_(start)
        if self.buffer is not None:
            self.buffer.copy_(state["momentum_buffer"])
        self.steps_in_round = int(state["steps_in_round"])
        self.rounds = int(state["rounds"])
