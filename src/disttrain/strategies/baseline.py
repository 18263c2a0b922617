"""The baseline strategy: one process, a plain PyTorch step, the control group.

    disttrain baseline --dataset mnist --num-epochs 2
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.faults import FaultInjector
from disttrain.core.processes import sigterm_handled_by
from disttrain.core.store_check import check_checkpoint_dir
from disttrain.data import ArrayDataset, ShardedSampler, load_datasets
from disttrain.metrics.hparams import write_hparams
from disttrain.metrics.progress import Progress
from disttrain.metrics.summary import RunSummary, Work
from disttrain.training.checkpoints import LocalCheckpoints
from disttrain.training.engine import (
    EvalResult,
    StepResult,
    build_optimizer,
    configure_process,
    evaluate,
    forward_backward,
)
from disttrain.training.first_step import check_first_step
from disttrain.training.loading import BatchSource, prefetch
from disttrain.training.loop import LoopSettings, TrainingLoop
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions
from disttrain.training.precision import Precision, PrecisionPlan, plan_precision
from disttrain.training.seeding import seed_training
from disttrain.training.stepping import OptimizerStep
from disttrain.training.strategy import StepInfo

# The face of a strategy of one module, as a package's __init__ is the face of the others.
__all__ = ["STRATEGY"]

logger = logging.getLogger(__name__)

FINAL_MODEL = "baseline_final.pt"


class BaselineParticipant:
    """A model and its optimizer in this process; nothing crosses a process boundary."""

    strategy = "baseline"

    def __init__(self, model: torch.nn.Module, stepper: OptimizerStep,
                 train_set: BatchSource, test_set: ArrayDataset, eval_batch_size: int,
                 precision: Precision | None = None):
        self.model = model
        self.stepper = stepper
        self.precision = precision
        self.train_set = train_set
        self.test_set = test_set
        self.eval_batch_size = eval_batch_size

    def start(self) -> None:
        """Nothing to wait for."""

    def step(self, batches: list[torch.Tensor], info: StepInfo) -> StepResult:
        (indices,) = batches
        inputs, targets = self.train_set.batch(indices)
        self.stepper.optimizer.zero_grad(set_to_none=True)
        result = forward_backward(self.model, inputs, targets, precision=self.precision)
        self.stepper.step()
        result.scalars.update(self.stepper.scalars())
        return result

    def evaluate(self, epoch: int) -> EvalResult:
        return evaluate(self.model, self.test_set, self.eval_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), **self.stepper.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.stepper.load_state_dict(state)


def baseline_precision(mode: str) -> PrecisionPlan:
    """The baseline computes on the CPU: bf16 autocast, no fp16 (its loss scaling is
    CUDA's). Raises ConfigError for fp16."""
    return plan_precision(mode, "cpu")


class Baseline:
    name = "baseline"

    def run(self, config: Config, options: RunOptions) -> RunSummary:
        """Train in this process and return the run summary.

        Raises:
            DataError, CheckpointError, ConfigError: bad data, checkpoint or folder; nothing
                on disk is overwritten.
        """
        training, system = config.training, config.system
        started = time.perf_counter()
        check_checkpoint_dir(system.checkpoint_dir, self.name, in_this_process=True)
        configure_process(system.num_threads)
        check_first_step(training)  # one line, exit code 2, for a model that cannot take the data
        train_set, test_set = load_datasets(training)
        model = init_model(training)
        seed_training(training.seed, rank=0)
        precision = Precision(baseline_precision(training.precision))
        stepper = OptimizerStep(build_optimizer(model.parameters(), training), training)
        loader = prefetch(train_set, training.loader_workers)
        participant = BaselineParticipant(model, stepper, loader or train_set, test_set,
                                          training.eval_batch_size, precision)
        sampler = ShardedSampler(len(train_set), seed=training.seed)
        checkpoint_dir, log_dir = system.checkpoint_dir, Path(system.log_dir)  # the former may be a URL
        loop = TrainingLoop(LoopSettings.of(config.training, config.to_dict()), participant, sampler,
                            LocalCheckpoints(checkpoint_dir, system.checkpoint_keep), log_dir / self.name,
                            FaultInjector(options.faults, "worker", 0),
                            lambda total, done: Progress(total, "train", initial=done),
                            config_path=log_dir / "config.yaml", loader=loader,
                            stop_requested=threading.Event())
        stop = loop.stop_requested  # set by SIGTERM: the loop stops at the step's end with a checkpoint
        with sigterm_handled_by(lambda signum, frame: stop.set()):
            result = loop.run(options.resume)
        ckpt.save_final_model(object_store.join(checkpoint_dir, FINAL_MODEL), model.state_dict(), config)
        work = Work(samples_processed=result.position.samples_processed, steps=result.position.step,
                    world_size=1, total_time_s=time.perf_counter() - started,
                    train_time_s=result.position.train_time_s)
        summary = RunSummary.create(
            self.name, config, result.outcome, work,
            extra={"resumed_from_step": result.resumed_from_step})
        summary.write(log_dir)
        write_hparams(summary, log_dir)
        return summary


STRATEGY = Baseline()
