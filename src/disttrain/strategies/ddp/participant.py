"""The one DDP participant in the training loop, under either recovery policy.

A DDP rank's step is the same whichever way its run recovers from a lost rank: its
micro-batches' forward and backward through torch's DDP module (bucketed all-reduces
overlapped with backward, the timing hook around the compression hook, if any), all but
the last under `no_sync()`; the optimizer step; with local updates (`training.sync_every`)
a step of the plain module instead, averaged at the round's end (`local_updates`).
What the recovery policy (`Recovery`) decides around it is whether the process group may
re-form between two steps:

- restart mode (`rank.RestartRecovery`): the group is the process's, wrapped once; a
  lost rank ends every rank's process and the elastic agent starts them again from the
  newest checkpoint, each rank's own pieces in it.
- live recovery (`live.participant.LiveRecovery`): at a step boundary the group may
  change (ranks join, members leave, a peer was lost), and the survivors train on from
  the group's state (position and data ledger included), wrapped again for each
  generation.

Either way the loop hands the step its batches (the sampler's pieces of the global
batches, split evenly or by a balance plan), and each micro-batch's loss is weighted by
its share of the step's global batches, so the all-reduce's average is the gradient of
one batch holding them all, whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from disttrain.compression.ddp_hooks import CompressionHook, build_ddp_hook, run_hook
from disttrain.config import CompressionConfig, DDPConfig, TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook
from disttrain.strategies.ddp.local_updates import LocalRounds
from disttrain.strategies.ddp.reduce import evaluate_sharded
from disttrain.training.engine import (
    EvalResult,
    Inputs,
    StepResult,
    build_optimizer,
    forward_backward,
    to_device,
)
from disttrain.training.loading import BatchSource
from disttrain.training.models import init_model
from disttrain.training.precision import Precision, plan_precision
from disttrain.training.seeding import seed_training, training_seed
from disttrain.training.stepping import OptimizerStep
from disttrain.training.strategy import StepInfo


def scaled_learning_rate(learning_rate: float, scaling: str, world_size: int) -> float:
    """`linear` multiplies the rate by the world size (the global batch grew that much)."""
    if scaling == "linear":
        return learning_rate * world_size
    if scaling == "none":
        return learning_rate
    raise ConfigError(f"ddp.lr_scaling: unknown rule {scaling!r}; use none or linear")


def wrap_model(module: torch.nn.Module, ddp: DDPConfig, device: torch.device, comm: CommStats,
               compression: CompressionHook | None) -> DistributedDataParallel:
    """DDP around `module` (which already sits on `device`) over the default process group,
    with the timing communication hook (around compression's, if any): restart mode wraps
    once per process, live recovery once per generation of its group. Broadcasts rank 0's
    weights and buffers (a collective)."""
    device_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=ddp.bucket_cap_mb,
                                    gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                                    static_graph=ddp.static_graph,
                                    find_unused_parameters=ddp.find_unused_parameters)
    if compression is None:
        register_comm_hook(model, comm)
    else:
        register_comm_hook(model, comm, run_hook, compression)
    return model


def compression_hook(compression: CompressionConfig, seed: int, module: torch.nn.Module, rank: int,
                     world_size: int) -> CompressionHook | None:
    """The run's gradient-compression hook (`seed`: the training seed), or None when
    compression is off."""
    if not compression.enabled:
        return None
    return build_ddp_hook(compression, module.named_parameters(), seed, training_seed(seed, rank), world_size)


@dataclass(frozen=True)
class RankTraining:
    """What a DDP rank trains with, in either recovery mode: its plain module (checkpoints
    and evaluation read it; DDP wraps it), optimizer at the scaled learning rate, precision,
    optimizer step, the timing hook's figures and the compression hook (None: off)."""

    module: torch.nn.Module
    learning_rate: float
    optimizer: torch.optim.Optimizer
    precision: Precision
    stepper: OptimizerStep
    comm: CommStats
    compression: CompressionHook | None

    @classmethod
    def build(cls, training: TrainingConfig, ddp: DDPConfig, compression: CompressionConfig,
              device: torch.device, rank: int, world_size: int) -> RankTraining:
        """For `rank` of a run of `world_size` ranks (what `ddp.lr_scaling` scales by and
        `compression.ddp_collective: auto` chooses for): the model built and the rank's
        training seed set, as every strategy does."""
        module = init_model(training).to(device)
        seed_training(training.seed, rank)
        learning_rate = scaled_learning_rate(training.learning_rate, ddp.lr_scaling, world_size)
        optimizer = build_optimizer(module.parameters(), training, learning_rate)
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = Precision(plan_precision(training.precision, device.type, bf16), device)
        # Clipping and the schedule act on the averaged gradient: the step runs after the
        # last backward, whose all-reduce (and compression hook) has finished by then.
        stepper = OptimizerStep(optimizer, training, precision.scaler)
        hook = compression_hook(compression, training.seed, module, rank, world_size)
        return cls(module, learning_rate, optimizer, precision, stepper, CommStats(), hook)


@dataclass(frozen=True)
class RankData:
    """What a rank reads: its training batches (a data set, or the loader workers reading
    it), the test set, the loop's sampler (a `PlannedSampler` splits each global batch by
    its plan and weighs each rank's loss by its share; None: the even split of a test
    that hands its own batches) and the evaluation's batch size."""

    train: BatchSource
    test: ArrayDataset
    sampler: ShardedSampler | PlannedSampler | None
    eval_batch_size: int


class Recovery(Protocol):
    """What a recovery policy decides around the one step: where the rank stands in its
    group, the module a step trains through, what happens at a step boundary and after a
    step is applied, and what a checkpoint of the rank holds."""

    strategy: str  # the tag of the loop's checkpoints

    def start(self) -> None:
        """Right before the loop's clock starts (restart mode: every rank's together)."""
        ...

    def place(self) -> tuple[int, int]:
        """This rank's (rank, world size) in its group now; asked before each evaluation,
        which is where a policy settles the last step first (live: its speed under
        `system.balance`, a collective at a check)."""
        ...

    def begin_step(self, samples: int) -> torch.nn.Module:
        """Before a step of `samples` samples: the step boundary's business (live: the
        group's changes, which may end the generation's run) done; returns the module the
        step trains through (the DDP module, or with local updates the plain one)."""
        ...

    def end_step(self, batches: int, scalars: dict[str, float]) -> None:
        """A step over `batches` global batches was applied, its figures `scalars` (with
        local updates, `local/rounds` says whether a round was averaged)."""
        ...

    def evaluated(self, result: EvalResult) -> None:
        """The epoch's evaluation is `result` (live: recorded in the run's progress)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


def train_micro_batches(model: torch.nn.Module, count: int,
                        micro_batch: Callable[[int], tuple[Inputs, torch.Tensor, float]],
                        precision: Precision) -> tuple[float, int, int]:
    """Forward and backward of `count` micro-batches (`micro_batch(i)`: inputs, targets
    and the loss's weight), gradients accumulated; a model in DDP all-reduces in the last
    backward only (the others run under `no_sync()`). Returns the loss summed over the
    samples, the correct predictions and the samples.

    Raises:
        RuntimeError, dist.DistError: the all-reduce failed (a peer was lost).
    """
    loss_sum, correct, samples = 0.0, 0, 0
    for i in range(count):
        inputs, targets, weight = micro_batch(i)
        last = i == count - 1
        with model.no_sync() if isinstance(model, DistributedDataParallel) and not last else nullcontext():
            result = forward_backward(model, inputs, targets, weight, precision)
        loss_sum += result.loss * result.num_samples
        correct, samples = correct + result.num_correct, samples + result.num_samples
    return loss_sum, correct, samples


class DDPParticipant:
    """One DDP rank's part in the loop, under its recovery policy: the step, the sharded
    evaluation, and the checkpoint pieces the policy keeps.

    Args:
        training: the rank's model, optimizer, precision, optimizer step and hooks.
        rounds: local updates' rounds over the same module (None: averaged every step).
        data: the batches it trains on and the test set.
        recovery: the recovery policy (restart mode's or live recovery's).
    """

    def __init__(self, training: RankTraining, rounds: LocalRounds | None, data: RankData,
                 recovery: Recovery):
        self.training, self.rounds, self.data, self.recovery = training, rounds, data, recovery
        self.module, self.optimizer, self.precision = training.module, training.optimizer, training.precision
        self.stepper, self.comm, self.compression = training.stepper, training.comm, training.compression

    @property
    def strategy(self) -> str:
        """The recovery policy's tag: restart mode's checkpoints and live ones differ."""
        return self.recovery.strategy

    def start(self) -> None:
        self.recovery.start()

    def step(self, batches: list[torch.Tensor], info: StepInfo) -> StepResult:
        """One optimizer step over the micro-batches in `batches` (sample indices).

        Each micro-batch's loss is weighted by its share of the step's samples, so the
        gradient is that of one batch holding them all; only the last backward all-reduces.
        Under a planned split the rank's batch is weighted by its share of the global
        batch too (times the world size, which the all-reduce's average divides out).

        Raises:
            RuntimeError, dist.DistError: a peer was lost in a collective (nothing applied).
            Exception: what the recovery policy raises at the step boundary (live: the
                group changes).
        """
        total = sum(len(indices) for indices in batches)
        model = self.recovery.begin_step(total)
        self.optimizer.zero_grad(set_to_none=True)
        sampler, device = self.data.sampler, self.training.precision.device
        weight = 1.0 if not isinstance(sampler, PlannedSampler) else \
            sampler.world_size * total / (sampler.global_batch * len(batches))

        def micro_batch(i: int) -> tuple[Inputs, torch.Tensor, float]:
            inputs, targets = self.data.train.batch(batches[i])
            return (to_device(inputs, device, True), targets.to(device, non_blocking=True),
                    weight * len(batches[i]) / total)

        loss_sum, correct, _ = train_micro_batches(model, len(batches), micro_batch, self.precision)
        self.stepper.step()
        if self.rounds is not None:
            scalars = self.rounds.end_of_step(info.ends_epoch)
        else:
            scalars = self.comm.drain().scalars()
        self.recovery.end_step(len(batches), scalars)
        scalars.update(self.stepper.scalars())
        if self.compression is not None:
            scalars.update(self.compression.stats.drain().scalars())
        return StepResult(loss_sum / total, correct, total, scalars)

    def evaluate(self, epoch: int) -> EvalResult:
        """Every rank evaluates a slice of the test set (a collective)."""
        rank, world_size = self.recovery.place()
        result = evaluate_sharded(self.module, self.data.test, self.data.eval_batch_size, rank, world_size,
                                  self.training.precision.device)
        self.recovery.evaluated(result)
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.recovery.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recovery.load_state_dict(state)
