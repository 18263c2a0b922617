"""One DDP rank's run: the training loop every rank executes, started by the elastic agent.

Reads top to bottom like the baseline: join the process group, build model, data and
optimizer, maybe resume (from `--resume`, or automatically on an elastic restart), wrap
the model in DDP, then for each epoch take this rank's batches, step, log, checkpoint;
evaluate at each epoch end; rank 0 writes the final model and the summary.

A step takes `grad_accumulation_steps` micro-batches; all but the last run under
`no_sync()`, so gradients cross the network once per step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from disttrain import checkpoint as ckpt
from disttrain.baseline import Position
from disttrain.config import Config, DDPConfig
from disttrain.data import ArrayDataset, ShardedSampler, load_datasets
from disttrain.ddp import runtime as rt
from disttrain.ddp import state as ddp_state
from disttrain.ddp.comm_hooks import CommSample, CommStats, register_comm_hook
from disttrain.ddp.precision import Precision, plan_precision
from disttrain.ddp.reduce import all_reduce_values, evaluate_sharded
from disttrain.ddp.rng import gather_rng_states
from disttrain.engine import EvalResult, StepResult, build_optimizer, seed_everything
from disttrain.errors import CheckpointError, ConfigError
from disttrain.faults import Fault, FaultInjector
from disttrain.metrics import MetricsLogger, Progress, RunSummary, StepTimer, TrainWindow
from disttrain.models import build_model

logger = logging.getLogger(__name__)

STRATEGY = ddp_state.STRATEGY
FINAL_MODEL = "ddp_final.pt"
NO_CHECKPOINT = -1


def scaled_learning_rate(learning_rate: float, scaling: str, world_size: int) -> float:
    """`linear` multiplies the rate by the world size (the global batch grew that much)."""
    if scaling == "linear":
        return learning_rate * world_size
    if scaling == "none":
        return learning_rate
    raise ConfigError(f"ddp.lr_scaling: unknown rule {scaling!r}; use none or linear")


def make_sampler(num_samples: int, world_size: int, rank: int, seed: int) -> ShardedSampler:
    """This rank's shard of the training set.

    Raises:
        ConfigError: fewer samples than ranks.
    """
    if num_samples < world_size:
        raise ConfigError(f"system.num_workers: world size {world_size} is larger than the "
                          f"{num_samples} training samples; use --world-size {num_samples} or "
                          "fewer, or more data")
    return ShardedSampler(num_samples, world_size=world_size, rank=rank, seed=seed)


def accumulation_groups(batches: Iterator[torch.Tensor], size: int) -> Iterator[list[torch.Tensor]]:
    """Group consecutive batches by `size`; the epoch's last group may be shorter."""
    group: list[torch.Tensor] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def wrap_model(module: torch.nn.Module, ddp: DDPConfig, runtime: rt.Runtime
               ) -> DistributedDataParallel:
    """DDP around `module` (which already sits on the rank's device); broadcasts rank 0's weights."""
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=ddp.bucket_cap_mb,
                                   gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                                   static_graph=ddp.static_graph)


def train_step(model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
               precision: Precision, dataset: ArrayDataset, group: list[torch.Tensor],
               device: torch.device) -> StepResult:
    """One optimizer step over the micro-batches in `group` (sample indices).

    Each micro-batch's loss is weighted by its share of the group's samples, so the
    gradient is that of one batch holding them all; only the last backward all-reduces.
    """
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(indices) for indices in group)
    loss_sum, correct = 0.0, 0
    for i, indices in enumerate(group):
        inputs, targets = dataset.batch(indices)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        sync = i == len(group) - 1
        with nullcontext() if sync else model.no_sync():
            result = precision.forward_backward(model, inputs, targets, len(indices) / total)
        loss_sum += result.loss * result.num_samples
        correct += result.num_correct
    precision.step(optimizer)
    return StepResult(loss_sum / total, correct, total)


@dataclass
class Window(TrainWindow):
    """A metrics window that also sums what the timing hook saw of communication."""

    comm: CommSample = field(default_factory=CommSample)

    def add_step(self, result: StepResult, comm: CommSample) -> None:
        self.add(result.loss, result.num_correct, result.num_samples)
        self.comm.seconds += comm.seconds
        self.comm.num_bytes += comm.num_bytes
        self.comm.num_buckets += comm.num_buckets

    def step_scalars(self, now: float, step_seconds: float) -> dict[str, float]:
        """Per-step means; `time/compute_s` is the step time with no all-reduce in flight."""
        steps, comm = max(self.num_steps, 1), self.comm
        return {
            **self.scalars(now),
            "time/step_s": step_seconds / steps,
            "time/comm_s": comm.seconds / steps,
            "time/compute_s": max(step_seconds - comm.seconds, 0.0) / steps,
            "comm/bytes_allreduced": comm.num_bytes / steps,
        }


def agree_on_checkpoint(checkpoint_dir: Path, resume: bool, runtime: rt.Runtime) -> Path | None:
    """Rank 0 picks the checkpoint to resume from and tells the others (one broadcast), so
    every rank loads the same one. A collective.

    Raises:
        ConfigError: (rank 0) a fresh run found checkpoints of an earlier run.
        CheckpointError: (other ranks) the chosen file is not visible from this node.
    """
    step = NO_CHECKPOINT
    if runtime.info.is_main:
        chosen = ckpt.prepare_checkpoint_dir(checkpoint_dir, resume)
        step = NO_CHECKPOINT if chosen is None else ckpt.checkpoint_step(chosen)
    tensor = torch.tensor([step], dtype=torch.int64, device=runtime.device)
    dist.broadcast(tensor, src=0)
    step = int(tensor.item())
    if step == NO_CHECKPOINT:
        return None
    path = checkpoint_dir / ckpt.checkpoint_name(step)
    if not path.is_file():
        raise CheckpointError(f"rank 0 resumes from {path.name} but rank {runtime.info.rank} "
                                   f"cannot see it in {checkpoint_dir}; put system.checkpoint_dir "
                                   "on storage every node shares")
    return path


def train(config: Config, info: rt.RankInfo, resume: bool = False,
          summary_json: str | Path | None = None, faults: list[Fault] | tuple[Fault, ...] = ()
          ) -> RunSummary | None:
    """Run this rank to the end; rank 0 returns the summary, the others None.

    An elastic restart (`info.restart_count > 0`) resumes from the newest checkpoint.

    Raises:
        ConfigError, DataError, CheckpointError, DistributedError: the rank exits with its
        message; the agent then stops the other ranks (and restarts them if allowed).
    """
    started = time.perf_counter()
    runtime = rt.start(config.ddp, info, config.system.num_threads)
    try:
        summary = _run(config, runtime, resume or info.restart_count > 0, summary_json, faults,
                       started)
        rt.shutdown(runtime)
    except (RuntimeError, dist.DistError) as e:
        if rt.is_peer_loss(e):
            raise rt.peer_loss_error(e) from e
        raise
    return summary


@dataclass
class Rank:
    """What one rank trains with, built by `build_rank`."""

    train_set: ArrayDataset
    test_set: ArrayDataset
    sampler: ShardedSampler
    module: torch.nn.Module  # the plain model: checkpoints, evaluation, the final file
    model: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    precision: Precision
    comm: CommStats
    learning_rate: float
    position: Position
    resumed_from: Path | None


def build_rank(config: Config, runtime: rt.Runtime, resume: bool) -> Rank:
    """Data, model, optimizer and precision; restore a checkpoint if resuming; wrap in DDP
    and register the communication hook. Every rank builds the same model from the seed."""
    training, ddp, info, device = config.training, config.ddp, runtime.info, runtime.device
    seed_everything(training.seed)
    train_set, test_set = load_datasets(training)
    sampler = make_sampler(len(train_set), info.world_size, info.rank, training.seed)
    module = build_model(training.model_architecture, train_set.input_shape,
                         train_set.num_classes, training).to(device)
    seed_everything(training.seed + info.rank)  # each rank draws its own dropout masks
    learning_rate = scaled_learning_rate(training.learning_rate, ddp.lr_scaling, info.world_size)
    optimizer = build_optimizer(module.parameters(), training, learning_rate)
    precision = Precision(plan_precision(ddp.mixed_precision, device.type, _bf16_supported(device)),
                          device)
    resumed_from = agree_on_checkpoint(Path(config.system.checkpoint_dir), resume, runtime)
    position = Position()
    if resumed_from is not None:
        position = ddp_state.restore(resumed_from, info.rank, info.world_size, module, optimizer,
                                     sampler, precision)
    model = wrap_model(module, ddp, runtime)
    comm = CommStats()
    register_comm_hook(model, comm)
    return Rank(train_set, test_set, sampler, module, model, optimizer, precision, comm,
                learning_rate, position, resumed_from)


def _run(config: Config, runtime: rt.Runtime, resume: bool, summary_json, faults,
         started: float) -> RunSummary | None:
    training, system, ddp = config.training, config.system, config.ddp
    info, device = runtime.info, runtime.device
    system.num_workers = info.world_size  # the config records what actually ran
    rank = build_rank(config, runtime, resume)
    position, sampler, comm = rank.position, rank.sampler, rank.comm
    checkpoint_dir, log_dir = Path(system.checkpoint_dir), Path(system.log_dir)
    if info.is_main:
        config.save(log_dir / "config.yaml")
    metrics = MetricsLogger(log_dir / f"rank{info.rank}",
                            resume_step=position.step if rank.resumed_from is not None else None)
    faults_here = FaultInjector(faults, rank=info.rank, attempt=info.restart_count)
    timer = StepTimer()
    steps_per_epoch = math.ceil(sampler.num_batches(training.batch_size) / ddp.grad_accumulation_steps)
    progress = Progress(steps_per_epoch * training.num_epochs, "train", initial=position.step,
                        enabled=info.is_main)

    def save() -> None:
        rng_states = gather_rng_states(info.world_size, device)
        metrics.flush()  # the records a resume from this checkpoint keeps are on disk
        if info.is_main:
            ckpt.save_checkpoint(checkpoint_dir, position.step, ddp_state.build_state(
                config, rank.module, rank.optimizer, sampler, rank.precision, position, rng_states),
                keep=system.checkpoint_keep)

    def evaluate_all():
        return evaluate_sharded(rank.module, rank.test_set, training.eval_batch_size, info.rank,
                                info.world_size, device)

    rt.barrier(runtime)  # start the clock together: setup skew between ranks is not training time
    window = Window(started=time.perf_counter())
    loop_start = time.perf_counter() - position.train_time_s
    result = None
    for epoch in range(position.epoch, training.num_epochs):
        sampler.set_epoch(epoch)
        position.epoch = epoch
        for group in accumulation_groups(sampler.batches(training.batch_size),
                                         ddp.grad_accumulation_steps):
            with timer.phase("step"):
                step_result = train_step(rank.model, rank.optimizer, rank.precision, rank.train_set,
                                         group, device)
            position.step += 1
            position.samples_processed += step_result.num_samples
            window.add_step(step_result, comm.drain())
            progress.update(1, loss=step_result.loss)
            if position.step % training.log_interval == 0:
                now = time.perf_counter()
                metrics.log(position.step, epoch,
                            window.step_scalars(now, timer.drain().get("time/step_s", 0.0)))
                window = Window(started=now)
            if position.step % training.checkpoint_interval == 0:
                position.train_time_s = time.perf_counter() - loop_start
                save()
            faults_here.at_step(position.step)
        position.train_time_s = time.perf_counter() - loop_start
        result = evaluate_all()
        metrics.log(position.step, epoch, {"loss/test": result.loss, "accuracy/test": result.accuracy})
        if info.is_main:
            logger.info("epoch %d: test accuracy %.4f, test loss %.4f", epoch, result.accuracy,
                        result.loss)
        window = Window(started=time.perf_counter())
    progress.close()
    if result is None:  # resumed a finished run: nothing left to train
        result = evaluate_all()
    if position.step % training.checkpoint_interval != 0:
        save()
    metrics.close()
    return finish(config, runtime, rank, result, started, summary_json)


def finish(config: Config, runtime: rt.Runtime, rank: Rank, result: EvalResult, started: float,
           summary_json: str | Path | None) -> RunSummary | None:
    """Totals over all ranks (a collective); then rank 0 writes the final model and summary."""
    position, info = rank.position, runtime.info
    samples, = all_reduce_values([position.samples_processed], runtime.device)
    train_time_s, = all_reduce_values([position.train_time_s], runtime.device, dist.ReduceOp.MAX)
    if not info.is_main:
        return None
    ckpt.save_final_model(Path(config.system.checkpoint_dir) / FINAL_MODEL, rank.module.state_dict(),
                          config)
    resumed_from_step = None if rank.resumed_from is None else ckpt.checkpoint_step(rank.resumed_from)
    summary = RunSummary(
        strategy=STRATEGY, dataset=config.training.dataset, final_accuracy=result.accuracy,
        final_loss=result.loss, total_time_s=time.perf_counter() - started,
        throughput_samples_per_s=samples / max(train_time_s, 1e-9),
        samples_processed=int(samples), steps=position.step, epochs=config.training.num_epochs,
        world_size=info.world_size, config=config.to_dict(),
        extra={"backend": runtime.backend, "device": str(runtime.device),
               "train_time_s": train_time_s, "learning_rate": rank.learning_rate,
               "restarts": info.restart_count, "resumed_from_step": resumed_from_step},
    )
    summary.write(config.system.log_dir, summary_json)
    return summary


def _bf16_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()
