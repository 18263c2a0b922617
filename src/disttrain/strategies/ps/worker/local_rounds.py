"""Local-update training on a parameter-server worker: its rounds, apart from the wire.

In this mode (`training.sync_every` H > 1, or `training.local_updates`) a worker takes H
steps with its own inner optimizer (`training.optimizer`, its schedule and clipping) on
its own copy of the model, pushing and pulling nothing. At a round's end (H steps, or
the epoch's last) it pushes the pseudo-gradient, the round-start parameters minus its
current ones, through the ordinary push path (so compression applies to it), as one
push that stands for the round's samples: sync aggregation averages the workers'
pseudo-gradients by their samples, and each shard applies the OUTER optimizer
(`server.optimizer.outer_training`) to the round-start parameters it holds. The worker
pulls the result and opens its next round there; its inner optimizer state stays its own.

A round's push is named by the round (its `step` is the round's number, 1 on), and
carries the block of the round's last batch: the servers' ledgers hold one block per
round, which stands for every batch of that round (`round_end`). A worker lost mid-round
redoes the round from its checkpoint (nothing of it was applied).

A *redone* round is one a shard lost after applying it (it came back from an older
checkpoint), or one of a worker given up on (reassigned), found missing from a ledger at
an epoch's end. A worker trains the round's batches again as inner steps from the
parameters of the moment, with its inner optimizer as it stands then (`redo`), and
pushes the pseudo-gradient as a redo of the round's block (its last batch's) to the
shards that lack it, standing for the round's samples: each shard applies it on arrival
with its outer optimizer, as a lost block is redone without local updates. It is an
extra push beside the worker's own rounds, which it leaves as they were (`aside`): their
inner optimizer state, schedule, round-start copy and place in the round.

The model's buffers (BatchNorm statistics) are taken from the servers at a round's start
and the round's change to them goes with its push.

The overlapped push during backward (`ps.overlap`) is off in this mode: a push leaves
once per round, after the round's last inner step, not during a backward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from disttrain.config import TrainingConfig
from disttrain.strategies.ps.wire.sharding import trainable_parameters
from disttrain.training.engine import StepResult, build_optimizer
from disttrain.training.local_updates import LocalUpdates, OuterOptimizer
from disttrain.training.stepping import OptimizerStep

logger = logging.getLogger(__name__)


def round_end(index: int, batches_per_epoch: int, sync_every: int) -> int:
    """The index of the last batch of the round that holds batch `index` of an epoch
    (rounds start at each epoch's first batch, and the epoch's last batch ends one)."""
    return min(batches_per_epoch - 1, (index // sync_every + 1) * sync_every - 1)


class WorkerRounds:
    """One worker's rounds: its inner optimizer, its round-start copy, its place in the
    round and the samples the round has taken so far.

    Args:
        settings: H (the outer optimizer itself runs on the servers).
        model: the worker's model, whose trainable parameters are views of `flat` in
            `flat`'s order (`sharding.flat_parameters`).
        flat, grads: the model's flat parameters and gradients.
        training: the inner optimizer, its schedule and clipping.
    """

    def __init__(self, settings: LocalUpdates, model: nn.Module, flat: torch.Tensor, grads: torch.Tensor,
                 training: TrainingConfig):
        self.settings = settings
        self.flat, self.grads = flat, grads
        self.params = [p for _, p in trainable_parameters(model)]
        self.buffers = list(model.buffers())
        self.optimizer = build_optimizer(self.params, training)
        self.stepper = OptimizerStep(self.optimizer, training)
        # The outer step runs on the servers: this copy needs no momentum buffer.
        self.outer = OuterOptimizer(replace(settings, momentum=0.0), self.params)
        self.samples = 0  # the samples of the round's steps so far

    @property
    def opening(self) -> bool:
        """Whether the next step opens a round."""
        return self.outer.steps_in_round == 0

    @property
    def round_number(self) -> int:
        """The number of the round in progress (1 on): its push's `step`."""
        return self.outer.rounds + 1

    def open(self) -> None:
        """Start a round at the parameters the model holds (the servers' newest)."""
        self.outer.take_start(self.params)
        self.samples = 0

    def inner_step(self, num_samples: int, ends_epoch: bool) -> bool:
        """Apply the gradient just computed with the inner optimizer; True when it ends the round."""
        self.stepper.step()
        self.samples += num_samples
        return self.outer.end_of_step(ends_epoch)

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """Write the round's pseudo-gradient (round start minus now) into `grads`; returns a
        copy, for a push that must be sent again."""
        torch.sub(self.outer.start, self.flat, out=self.grads)
        return self.grads.clone()

    def close(self) -> None:
        """The round's push was taken and the model holds the servers' parameters after it."""
        self.outer.rounds += 1
        self.open()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Leave this worker's own training as it was before the block, whatever the block
        does with the model (a redone round): its parameters and buffers, its inner
        optimizer's state, its schedule, its round-start copy and place in the round."""
        saved, grad_norm = self.state_dict(), self.stepper.last_grad_norm
        buffers = [b.detach().clone() for b in self.buffers]
        try:
            yield
        finally:
            self.load_state_dict(saved)
            self.stepper.last_grad_norm = grad_norm
            with torch.no_grad():
                for buffer, value in zip(self.buffers, buffers, strict=True):
                    buffer.copy_(value)

    def redo(self, steps: Sequence[Callable[[], StepResult]]) -> StepResult:
        """Train a redone round (see the module's docstring) from the parameters the model
        holds: each of `steps` computes one batch's gradient into `grads`, applied as an
        inner step. Leaves the round's pseudo-gradient (the parameters before it minus
        after) in `grads` and returns the last step's result. Call inside `aside`: it moves
        the model, the inner optimizer and its schedule."""
        if not steps:
            raise ValueError("a redone round needs one batch at least")
        start = self.flat.detach().clone()
        for step in steps:
            result = step()
            self.stepper.step()
        with torch.no_grad():
            torch.sub(start, self.flat, out=self.grads)
        return result

    def scalars(self, ended: bool) -> dict[str, float]:
        """The step's figures: the inner optimizer's, and whether it ended a round."""
        return {**self.stepper.scalars(), "local/rounds": 1 if ended else 0}

    def state_dict(self) -> dict[str, Any]:
        """The worker's own: its model's parameters (mid-round they are not the servers'),
        its inner optimizer and schedule, its round-start copy and place in the round."""
        optimizer = self.optimizer.state_dict()  # its tensors are the live ones: copied
        optimizer["state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in entries.items()}
                              for k, entries in optimizer["state"].items()}
        return {"params": self.flat.clone(), "outer": self.outer.state_dict(), "optimizer": optimizer,
                "schedule": self.stepper.state.state_dict(), "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`.

        Raises:
            ValueError: it is of another model.
        """
        if state["params"].numel() != self.flat.numel():
            raise ValueError(f"its parameters hold {state['params'].numel()} values and this model "
                             f"{self.flat.numel()}")
        self.outer.load_state_dict(state["outer"])
        self.flat.copy_(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stepper.state.load_state_dict(state["schedule"])
        self.samples = int(state["samples"])
