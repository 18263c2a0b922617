"""The baseline strategy: one process, a plain PyTorch loop, the control group.

Reads top to bottom: set up, maybe resume, then for each epoch take batches from the
sampler, step, log, checkpoint; evaluate at each epoch end; write the summary.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from disttrain import checkpoint as ckpt
from disttrain.config import Config
from disttrain.data import ShardedSampler, load_datasets
from disttrain.engine import build_optimizer, configure_threads, evaluate, seed_everything, train_step
from disttrain.errors import CheckpointError
from disttrain.faults import Fault, FaultInjector
from disttrain.metrics import MetricsLogger, Progress, RunSummary, StepTimer, TrainWindow
from disttrain.models import build_model

logger = logging.getLogger(__name__)

STRATEGY = "baseline"
FINAL_MODEL = "baseline_final.pt"


@dataclass
class Position:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0
    step: int = 0
    samples_processed: int = 0
    train_time_s: float = 0.0


def train(config: Config, resume: bool = False, summary_json: str | Path | None = None,
          faults: list[Fault] | tuple[Fault, ...] = ()) -> RunSummary:
    """Train with the baseline strategy and return the run summary.

    Raises:
        DataError, CheckpointError: bad data or checkpoint; nothing on disk is overwritten.
    """
    training, system = config.training, config.system
    started = time.perf_counter()
    configure_threads(system.num_threads)
    seed_everything(training.seed)
    train_set, test_set = load_datasets(training)
    model = build_model(training.model_architecture, train_set.input_shape,
                        train_set.num_classes, training)
    optimizer = build_optimizer(model.parameters(), training)
    sampler = ShardedSampler(len(train_set), seed=training.seed)
    checkpoint_dir, log_dir = Path(system.checkpoint_dir), Path(system.log_dir)
    position = Position()
    resumed_from = ckpt.prepare_checkpoint_dir(checkpoint_dir, resume)
    if resumed_from is not None:
        position = _restore(resumed_from, model, optimizer, sampler)
    config.save(log_dir / "config.yaml")
    metrics = MetricsLogger(log_dir / STRATEGY,
                            resume_step=position.step if resumed_from is not None else None)
    faults_here = FaultInjector(faults)
    timer = StepTimer()
    batches_per_epoch = sampler.num_batches(training.batch_size)
    progress = Progress(batches_per_epoch * training.num_epochs, "train",
                        initial=position.step)

    def save(step: int) -> None:
        ckpt.save_checkpoint(checkpoint_dir, step, _state(config, model, optimizer, sampler,
                                                          position), keep=system.checkpoint_keep)

    window = TrainWindow()
    loop_start = time.perf_counter() - position.train_time_s
    result = None
    for epoch in range(position.epoch, training.num_epochs):
        sampler.set_epoch(epoch)
        position.epoch = epoch
        for indices in sampler.batches(training.batch_size):
            with timer.phase("compute"):
                inputs, targets = train_set.batch(indices)
                step_result = train_step(model, optimizer, inputs, targets)
            position.step += 1
            position.samples_processed += step_result.num_samples
            window.add(step_result.loss, step_result.num_correct, step_result.num_samples)
            progress.update(1, loss=step_result.loss)
            if position.step % training.log_interval == 0:
                metrics.log(position.step, epoch, {
                    **window.scalars(),
                    **{k: v / window.num_steps for k, v in timer.drain().items()},
                })
                window = TrainWindow()
            if position.step % training.checkpoint_interval == 0:
                position.train_time_s = time.perf_counter() - loop_start
                save(position.step)
            faults_here.at_step(position.step)
        position.train_time_s = time.perf_counter() - loop_start
        result = evaluate(model, test_set, training.eval_batch_size)
        metrics.log(position.step, epoch, {"loss/test": result.loss, "accuracy/test": result.accuracy})
        logger.info("epoch %d: test accuracy %.4f, test loss %.4f", epoch, result.accuracy,
                    result.loss)
        # Evaluation is not training: restart the clocks so throughput leaves it out.
        window.started = time.perf_counter()
        loop_start = window.started - position.train_time_s
    progress.close()
    if result is None:  # resumed a finished run: nothing left to train
        result = evaluate(model, test_set, training.eval_batch_size)
    if position.step % training.checkpoint_interval != 0:
        save(position.step)
    ckpt.save_final_model(checkpoint_dir / FINAL_MODEL, model.state_dict(), config)
    metrics.close()
    summary = RunSummary(
        strategy=STRATEGY, dataset=training.dataset, final_accuracy=result.accuracy,
        final_loss=result.loss, total_time_s=time.perf_counter() - started,
        throughput_samples_per_s=position.samples_processed / max(position.train_time_s, 1e-9),
        samples_processed=position.samples_processed, steps=position.step,
        epochs=training.num_epochs, world_size=1, config=config.to_dict(),
        extra={"train_time_s": position.train_time_s, "resumed_from_step":
               None if resumed_from is None else ckpt.checkpoint_step(resumed_from)},
    )
    summary.write(log_dir, summary_json)
    return summary


def _state(config: Config, model, optimizer, sampler: ShardedSampler, position: Position) -> dict:
    return {
        "strategy": STRATEGY,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": position.epoch,
        "step": position.step,
        "samples_processed": position.samples_processed,
        "train_time_s": position.train_time_s,
        "sampler": sampler.state_dict(),
        "rng": ckpt.rng_state(),
        "config": config.to_dict(),
    }


def _restore(path: Path, model, optimizer, sampler: ShardedSampler) -> Position:
    state = ckpt.load_strategy_checkpoint(path, STRATEGY, ("model", "optimizer", "sampler", "rng", "step"))
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from e
    ckpt.set_rng_state(state["rng"])
    logger.info("resumed from %s (epoch %d, step %d)", path, state["epoch"], state["step"])
    return Position(epoch=int(state["epoch"]), step=int(state["step"]),
                    samples_processed=int(state["samples_processed"]),
                    train_time_s=float(state["train_time_s"]))




def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The baseline takes the common training flags only."""


def main(args: argparse.Namespace, config: Config) -> RunSummary:
    return train(config, resume=args.resume, summary_json=args.summary_json, faults=args.faults)
