"""One DDP rank's run in restart mode, as the elastic agent (or torchrun) starts it: join
the process group, build data, model, optimizer and precision, wrap the model in DDP with
the timing communication hook (around a gradient-compression hook when
`compression.enabled`), then run the training loop with the one DDP participant
(`participant.DDPParticipant`) under restart mode's policy (`RestartRecovery`); rank 0
writes the final model and the summary. With a coordinator in the run
(`coordinator.address`), the rank registers as `rank{R}` and heartbeats its progress
meanwhile (`heartbeats`). SIGTERM (a preemption) stops every rank at a step they agree on,
with its checkpoint (`preemption`).

A step takes `grad_accumulation_steps` micro-batches; all but the last run under
`no_sync()`, so gradients cross the network once per step. With local updates
(`training.sync_every` > 1) the rank trains its plain model and synchronises once per
round instead (`local_updates`). An elastic restart (`restart_count > 0`) resumes from
the newest checkpoint, one of another number of ranks too (`resize`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain.compression.ddp_hooks import CompressionHook
from disttrain.config import Config, DDPConfig
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import Preempted
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import sigterm_handled_by
from disttrain.data import ArrayDataset, PlannedSampler, ShardedSampler, load_datasets
from disttrain.metrics.hparams import write_hparams
from disttrain.metrics.progress import Progress
from disttrain.metrics.summary import RunSummary, Work
from disttrain.strategies.ddp import runtime as rt
from disttrain.strategies.ddp.balance import balance_sampler
from disttrain.strategies.ddp.heartbeats import LoopProgress, coordinator_link
from disttrain.strategies.ddp.local_updates import LocalRounds, broadcast_module
from disttrain.strategies.ddp.participant import DDPParticipant, RankData, RankTraining, wrap_model
from disttrain.strategies.ddp.preemption import RankSignal, StopAgreement, stopped_line
from disttrain.strategies.ddp.reduce import all_reduce_values
from disttrain.strategies.ddp.store import RankZeroCheckpoints
from disttrain.training.checkpoints import Position
from disttrain.training.engine import EvalResult
from disttrain.training.loading import BatchSource, prefetch
from disttrain.training.local_updates import LocalUpdates
from disttrain.training.loop import LoopResult, LoopSettings, TrainingLoop
from disttrain.training.options import RunOptions
from disttrain.training.rebalance import plan_summary
from disttrain.training.schedule import INITIAL_LR

logger = logging.getLogger(__name__)

FINAL_MODEL = "ddp_final.pt"


class RestartRecovery:
    """Restart mode's policy for the one DDP participant (`participant.DDPParticipant`):
    the group is the process's, its DDP module made once; a lost rank ends every rank's
    process, and the elastic agent starts them again from the newest checkpoint. A
    checkpoint holds the rank's own pieces: model, optimizer, GradScaler and compression
    state (and with local updates the outer state and each rank's own model and optimizer).

    Args:
        training: the rank's model, optimizer and hooks.
        rounds: local updates' rounds (None: averaged every step, through DDP).
        runtime: the rank's process group and device.
        ddp: the DDP module's options.
    """

    strategy = "ddp"

    def __init__(self, training: RankTraining, rounds: LocalRounds | None, runtime: rt.Runtime,
                 ddp: DDPConfig):
        self.training, self.rounds, self.runtime = training, rounds, runtime
        # With local updates the rank steps its plain model: nothing crosses the network in a round.
        self.model = training.module if rounds is not None else wrap_model(
            training.module, ddp, runtime.device, training.comm, training.compression)
        self.learning_rate = training.learning_rate  # a resized checkpoint's goes on (`load_state_dict`)
        self.resized_from: int | None = None  # the world size of a resized checkpoint
        self.samples_extra = 0  # rank 0's samples over the others' since a resize

    def start(self) -> None:
        rt.barrier(self.runtime)  # every rank's clock starts together

    def place(self) -> tuple[int, int]:
        info = self.runtime.info
        return info.rank, info.world_size

    def begin_step(self, samples: int) -> torch.nn.Module:
        return self.model

    def end_step(self, batches: int, scalars: dict[str, float]) -> None:
        """Nothing to keep: the loop's position and checkpoints count the step."""

    def evaluated(self, result: EvalResult) -> None:
        """Nothing to keep: the loop logs the evaluation."""

    def summary_fields(self) -> dict[str, Any]:
        """The summary's local-update fields (the settings and the rounds completed), and the
        world size a resized checkpoint was written by."""
        fields: dict[str, Any] = {} if self.resized_from is None else {
            "resized_from_world_size": self.resized_from}
        if self.rounds is None:
            return fields
        return {**fields, **self.rounds.summary_fields()}

    def state_dict(self) -> dict[str, Any]:
        t = self.training
        state = {"world_size": self.runtime.info.world_size, "model": t.module.state_dict(),
                 **t.stepper.state_dict(), "grad_scaler": t.precision.state_dict()}
        if t.compression is not None:  # this rank's; the store gathers every rank's
            state["compression"] = t.compression.state_dict()
        if self.rounds is not None:  # the outer state is every rank's; the local state its own
            state["outer"] = self.rounds.outer.state_dict()
            state["local"] = self.rounds.local_state(t.optimizer)
        if self.samples_extra:  # what a later resize needs to count the run's samples
            state["samples_extra"] = self.samples_extra
        if self.resized_from is not None:  # its batch was resized: a later resume keeps it
            state["resized_from"] = self.resized_from
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ValueError when the checkpoint's compression or local updates do not
        match the run's."""
        t = self.training
        t.module.load_state_dict(state["model"])
        if "outer" in state and self.rounds is None:
            raise ValueError("it was written with local updates, whose ranks' models differ within "
                             "a round; resume with the run's training.sync_every")
        if self.rounds is not None and "outer" in state:
            self.rounds.outer.load_state_dict(state["outer"])
            state = {**state, "optimizer": self.rounds.load_local_state(state["local"], state["optimizer"])}
        elif self.rounds is not None:  # written averaging every step: a round starts at its model
            self.rounds.outer.take_start()
        t.stepper.load_state_dict(state)
        t.precision.load_state_dict(state["grad_scaler"])
        self.samples_extra = int(state.get("samples_extra", 0))
        if "resized_from" in state:  # the checkpoint's rate goes on: the global batch is kept
            self.resized_from = int(state["resized_from"])
            self.learning_rate = float(t.optimizer.param_groups[0].get(INITIAL_LR, self.learning_rate))
        # A resize dropped the old ranks' residuals (`resize`): this hook's fresh state goes on.
        if t.compression is not None and "compression" in state:
            t.compression.load_state_dict(state["compression"])
        elif t.compression is not None and not state.get("compression_dropped"):
            raise ValueError("it was written without gradient compression; resume with "
                             "compression.enabled=false")


def restart_participant(config: Config, runtime: rt.Runtime, data: tuple[BatchSource, ArrayDataset],
                        sampler: ShardedSampler | PlannedSampler | None = None) -> DDPParticipant:
    """A restart-mode rank's participant: its model built, optimizer, precision and hooks,
    and with local updates every rank starting the first round at rank 0's model."""
    training, info = config.training, runtime.info
    built = RankTraining.build(training, config.ddp, config.compression, runtime.device, info.rank,
                               info.world_size)
    local_updates = LocalUpdates.of(training)
    rounds = None
    if local_updates is not None:
        broadcast_module(built.module)  # every rank starts the first round at rank 0's model
        rounds = LocalRounds(local_updates, built.module, built.compression)
        if info.is_main:
            logger.info("%s", local_updates.describe())
    recovery = RestartRecovery(built, rounds, runtime, config.ddp)
    return DDPParticipant(built, rounds, RankData(*data, sampler, training.eval_batch_size), recovery)


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
    participant = restart_participant(config, runtime, (loader or train_set, test_set), sampler)
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


def finish(config: Config, runtime: rt.Runtime, participant: DDPParticipant, result: LoopResult,
           started: float) -> RunSummary | None:
    """Totals over all ranks (a collective); then rank 0 writes the final model and summary."""
    position, info = result.position, runtime.info
    samples, = all_reduce_values([position.samples_processed], runtime.device)
    train_time_s, = all_reduce_values([position.train_time_s], runtime.device, dist.ReduceOp.MAX)
    extra = compression_totals(participant.compression, runtime.device)
    recovery = participant.recovery
    assert isinstance(recovery, RestartRecovery)
    if not info.is_main:
        return None
    ckpt.save_final_model(object_store.join(config.system.checkpoint_dir, FINAL_MODEL),
                          participant.module.state_dict(), config)
    work = Work(samples_processed=int(samples), steps=position.step, world_size=info.world_size,
                total_time_s=time.perf_counter() - started, train_time_s=train_time_s)
    summary = RunSummary.create(
        "ddp", config, result.outcome, work,
        extra={"backend": runtime.backend, "device": str(runtime.device),
               "learning_rate": recovery.learning_rate, "restarts": info.restart_count,
               "resumed_from_step": result.resumed_from_step, **plan_summary(participant.data.sampler),
               **recovery.summary_fields(), **extra})
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
