"""One DDP rank's run, as the elastic agent (or torchrun) starts it: join the process
group, build data, model, optimizer and precision, wrap the model in DDP with the timing
communication hook (around a gradient-compression hook when `compression.enabled`), then
run the training loop; rank 0 writes the final model and the summary. With a coordinator
in the run (`coordinator.address`), the rank registers as `rank{R}` and heartbeats its
progress meanwhile (`heartbeats`). SIGTERM (a preemption) stops every rank at a step they
agree on, with its checkpoint (`preemption`).

A step takes `grad_accumulation_steps` micro-batches; all but the last run under
`no_sync()`, so gradients cross the network once per step. With local updates
(`training.sync_every` > 1) the rank trains its plain model and synchronises once per
round instead (`local_updates`). An elastic restart (`restart_count > 0`) resumes from
the newest checkpoint, one of another number of ranks too (`resize`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from disttrain.compression.ddp_hooks import CompressionHook, build_ddp_hook, run_hook
from disttrain.config import CompressionConfig, Config, DDPConfig, TrainingConfig
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import ConfigError, Preempted
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import sigterm_handled_by
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler, load_datasets
from disttrain.metrics.hparams import write_hparams
from disttrain.metrics.progress import Progress
from disttrain.metrics.summary import RunSummary, Work
from disttrain.strategies.ddp import runtime as rt
from disttrain.strategies.ddp.balance import balance_sampler
from disttrain.strategies.ddp.comm_hooks import CommStats, register_comm_hook
from disttrain.strategies.ddp.heartbeats import LoopProgress, coordinator_link
from disttrain.strategies.ddp.local_updates import LocalRounds, broadcast_module
from disttrain.strategies.ddp.preemption import RankSignal, StopAgreement, stopped_line
from disttrain.strategies.ddp.reduce import all_reduce_values, evaluate_sharded
from disttrain.strategies.ddp.store import RankZeroCheckpoints
from disttrain.training.checkpoints import Position
from disttrain.training.engine import (
    EvalResult,
    Inputs,
    StepResult,
    build_optimizer,
    forward_backward,
    to_device,
)
from disttrain.training.loading import BatchSource, prefetch
from disttrain.training.local_updates import LocalUpdates
from disttrain.training.loop import LoopResult, LoopSettings, TrainingLoop
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions
from disttrain.training.precision import Precision, plan_precision
from disttrain.training.rebalance import plan_summary
from disttrain.training.schedule import INITIAL_LR
from disttrain.training.seeding import seed_training, training_seed
from disttrain.training.stepping import OptimizerStep
from disttrain.training.strategy import StepInfo

logger = logging.getLogger(__name__)

FINAL_MODEL = "ddp_final.pt"


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


class RankParticipant:
    """One rank's part in the loop: a DDP step (or a local step, with local updates), a
    sharded evaluation, and the model, optimizer, GradScaler and compression state (and
    with local updates the outer state and each rank's own model and optimizer) as its
    checkpoint pieces."""

    strategy = "ddp"

    def __init__(self, training: TrainingConfig, ddp: DDPConfig, compression: CompressionConfig,
                 runtime: rt.Runtime, data: tuple[BatchSource, ArrayDataset],
                 sampler: ShardedSampler | PlannedSampler | None = None):
        device = runtime.device
        self.runtime = runtime
        self.sampler = sampler  # its balance plan, if any, weights this rank's loss
        self.train_set, self.test_set = data
        self.eval_batch_size = training.eval_batch_size
        info = runtime.info
        built = RankTraining.build(training, ddp, compression, device, info.rank, info.world_size)
        self.module, self.optimizer, self.precision = built.module, built.optimizer, built.precision
        self.stepper, self.comm, self.compression = built.stepper, built.comm, built.compression
        self.learning_rate = built.learning_rate  # a resized checkpoint's goes on (`load_state_dict`)
        local_updates = LocalUpdates.of(training)
        # With local updates the rank steps its plain model: nothing crosses the network in a round.
        if local_updates is not None:
            broadcast_module(self.module)  # every rank starts the first round at rank 0's model
        self.rounds = None if local_updates is None else LocalRounds(
            local_updates, self.module, self.compression)
        self.model = self.module if self.rounds is not None else wrap_model(
            self.module, ddp, device, self.comm, self.compression)
        self.resized_from: int | None = None  # the world size of a resized checkpoint
        self.samples_extra = 0  # rank 0's samples over the others' since a resize
        if local_updates is not None and runtime.info.is_main:
            logger.info("%s", local_updates.describe())

    def start(self) -> None:
        rt.barrier(self.runtime)  # every rank's clock starts together

    def step(self, batches: list[torch.Tensor], info: StepInfo) -> StepResult:
        """One optimizer step over the micro-batches in `batches` (sample indices).

        Each micro-batch's loss is weighted by its share of the step's samples, so the
        gradient is that of one batch holding them all; only the last backward all-reduces.
        Under a balance plan the rank's batch is weighted by its share of the global
        batch too (times the world size, which the all-reduce's average divides out).
        """
        self.optimizer.zero_grad(set_to_none=True)
        device = self.runtime.device
        total = sum(len(indices) for indices in batches)
        weight = 1.0 if not isinstance(self.sampler, PlannedSampler) else \
            self.runtime.info.world_size * total / (self.sampler.global_batch * len(batches))

        def micro_batch(i: int) -> tuple[Inputs, torch.Tensor, float]:
            inputs, targets = self.train_set.batch(batches[i])
            return (to_device(inputs, device, True), targets.to(device, non_blocking=True),
                    weight * len(batches[i]) / total)

        loss_sum, correct, _ = train_micro_batches(self.model, len(batches), micro_batch, self.precision)
        self.stepper.step()
        if self.rounds is not None:
            scalars = {**self.rounds.end_of_step(info.ends_epoch), **self.stepper.scalars()}
        else:
            scalars = {**self.comm.drain().scalars(), **self.stepper.scalars()}
        if self.compression is not None:
            scalars.update(self.compression.stats.drain().scalars())
        return StepResult(loss_sum / total, correct, total, scalars)

    def summary_fields(self) -> dict[str, Any]:
        """The summary's local-update fields (the settings and the rounds completed), and the
        world size a resized checkpoint was written by."""
        fields: dict[str, Any] = {} if self.resized_from is None else {
            "resized_from_world_size": self.resized_from}
        if self.rounds is None:
            return fields
        return {**fields, **self.rounds.summary_fields()}

    def evaluate(self, epoch: int) -> EvalResult:
        info = self.runtime.info
        return evaluate_sharded(self.module, self.test_set, self.eval_batch_size, info.rank,
                                info.world_size, self.runtime.device)

    def state_dict(self) -> dict[str, Any]:
        state = {"world_size": self.runtime.info.world_size, "model": self.module.state_dict(),
                 **self.stepper.state_dict(), "grad_scaler": self.precision.state_dict()}
        if self.compression is not None:  # this rank's; the store gathers every rank's
            state["compression"] = self.compression.state_dict()
        if self.rounds is not None:  # the outer state is every rank's; the local state its own
            state["outer"] = self.rounds.outer.state_dict()
            state["local"] = self.rounds.local_state(self.optimizer)
        if self.samples_extra:  # what a later resize needs to count the run's samples
            state["samples_extra"] = self.samples_extra
        if self.resized_from is not None:  # its batch was resized: a later resume keeps it
            state["resized_from"] = self.resized_from
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ValueError when the checkpoint's compression or local updates do not
        match the run's."""
        self.module.load_state_dict(state["model"])
        if "outer" in state and self.rounds is None:
            raise ValueError("it was written with local updates, whose ranks' models differ within "
                             "a round; resume with the run's training.sync_every")
        if self.rounds is not None and "outer" in state:
            self.rounds.outer.load_state_dict(state["outer"])
            state = {**state, "optimizer": self.rounds.load_local_state(state["local"], state["optimizer"])}
        elif self.rounds is not None:  # written averaging every step: a round starts at its model
            self.rounds.outer.take_start()
        self.stepper.load_state_dict(state)
        self.precision.load_state_dict(state["grad_scaler"])
        self.samples_extra = int(state.get("samples_extra", 0))
        if "resized_from" in state:  # the checkpoint's rate goes on: the global batch is kept
            self.resized_from = int(state["resized_from"])
            self.learning_rate = float(self.optimizer.param_groups[0].get(INITIAL_LR, self.learning_rate))
        # A resize dropped the old ranks' residuals (`resize`): this hook's fresh state goes on.
        if self.compression is not None and "compression" in state:
            self.compression.load_state_dict(state["compression"])
        elif self.compression is not None and not state.get("compression_dropped"):
            raise ValueError("it was written without gradient compression; resume with "
                             "compression.enabled=false")


def run_rank(config: Config, info: rt.RankInfo, options: RunOptions) -> RunSummary | None:
    """Run this rank to the end; rank 0 returns the summary, the others None.

    Raises:
        ConfigError, DataError, CheckpointError, DistributedError: the rank exits with its
        message; the agent then stops the other ranks (and restarts them if allowed).
        Preempted: the ranks stopped at a step they agreed on after a SIGTERM, with its
            checkpoint (exit code 143: the agent does not restart them).
    """
    started = time.perf_counter()
    rt.check_supported(config)
    progress = LoopProgress(Position(), config.training.num_epochs)
    rank_signal = RankSignal(info.rank, config.system.preemption_grace_s)
    with sigterm_handled_by(rank_signal.handle), coordinator_link(
            config.coordinator, info.rank, info.restart_count, progress, options.credentials):
        runtime = rt.start(config.ddp, info, config.system.num_threads)
        try:
            summary = _train(config, runtime, options, started, progress, rank_signal)
            rt.shutdown(runtime)
        except (RuntimeError, dist.DistError) as e:
            if rt.is_peer_loss(e):
                raise rt.peer_loss_error(e) from e
            raise
    return summary


def _train(config: Config, runtime: rt.Runtime, options: RunOptions, started: float,
           progress: LoopProgress, rank_signal: RankSignal) -> RunSummary | None:
    training, system, info = config.training, config.system, runtime.info
    train_set, test_set = load_datasets(training)
    rt.check_world_size(len(train_set), info.world_size)
    faults = FaultInjector(options.faults, "rank", info.rank, info.restart_count)
    sampler, rebalancer = balance_sampler(system, training, runtime, train_set, faults)
    progress.rebalancer = rebalancer  # its balance state goes into the heartbeats
    loader = prefetch(train_set, training.loader_workers, runtime.device.type)
    participant = RankParticipant(training, config.ddp, config.compression, runtime,
                                  (loader or train_set, test_set), sampler)
    log_dir = Path(system.log_dir)
    agreement = StopAgreement(rank_signal.requested, runtime.device)
    loop = TrainingLoop(
        LoopSettings.of(training, config.to_dict(), config.ddp.grad_accumulation_steps), participant,
        sampler, RankZeroCheckpoints(system.checkpoint_dir, system.checkpoint_keep, runtime,
                                     seed=training.seed, batch_size=training.batch_size),
        log_dir / f"rank{info.rank}", faults,
        lambda total, done: Progress(total, "train", initial=done, enabled=info.is_main),
        announce=info.is_main, config_path=log_dir / "config.yaml" if info.is_main else None,
        rebalancer=rebalancer, on_metrics=progress.metrics.publish, position=progress.position,
        loader=loader, stop_requested=agreement)
    try:
        result = loop.run(options.resume or info.restart_count > 0)
    except Preempted:  # every rank, at the same point, past the checkpoint's write (a collective)
        rank_signal.stopped()
        raise Preempted(stopped_line(loop.position.step)) from None
    agreement.settle()
    return finish(config, runtime, participant, result, started)


def finish(config: Config, runtime: rt.Runtime, participant: RankParticipant, result: LoopResult,
           started: float) -> RunSummary | None:
    """Totals over all ranks (a collective); then rank 0 writes the final model and summary."""
    position, info = result.position, runtime.info
    samples, = all_reduce_values([position.samples_processed], runtime.device)
    train_time_s, = all_reduce_values([position.train_time_s], runtime.device, dist.ReduceOp.MAX)
    extra = compression_totals(participant.compression, runtime.device)
    if not info.is_main:
        return None
    ckpt.save_final_model(object_store.join(config.system.checkpoint_dir, FINAL_MODEL),
                          participant.module.state_dict(), config)
    work = Work(samples_processed=int(samples), steps=position.step, world_size=info.world_size,
                total_time_s=time.perf_counter() - started, train_time_s=train_time_s)
    summary = RunSummary.create(
        "ddp", config, result.outcome, work,
        extra={"backend": runtime.backend, "device": str(runtime.device),
               "learning_rate": participant.learning_rate, "restarts": info.restart_count,
               "resumed_from_step": result.resumed_from_step, **plan_summary(participant.sampler),
               **participant.summary_fields(), **extra})
    summary.write(config.system.log_dir)
    write_hparams(summary, config.system.log_dir)
    return summary


def compression_totals(hook: CompressionHook | None, device: torch.device) -> dict[str, Any]:
    """The run's compression summary fields, over every rank (a collective); {} without."""
    if hook is None:
        return {}
    totals = hook.stats.totals()
    dense, sent = all_reduce_values([totals.bytes_dense, totals.bytes_sent], device)
    return {"compression_ratio": dense / sent if sent else None, "compression_bytes_sent": int(sent)}
