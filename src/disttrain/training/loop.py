"""The training loop every strategy runs: epochs, position, one clock, the metrics
window, log / checkpoint / fault cadence, and evaluation at each epoch end.

What differs between strategies comes in through a `Participant` (the step, the
evaluation, its own checkpoint pieces) and a `CheckpointStore` (who writes checkpoints).
The training clock stops during evaluation and checkpoint writes, so every throughput
figure leaves them out. A checkpoint due at an epoch's last step is written after that
epoch's evaluation, so a resumed run never evaluates (or logs) an epoch twice.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from disttrain.config import TrainingConfig
from disttrain.config.schema import write_config
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError, Preempted
from disttrain.core.faults import FaultInjector
from disttrain.data import LANGUAGE_MODEL, PlannedSampler, ShardedSampler, describe_dataset
from disttrain.data.datasets import shard_layout
from disttrain.data.shards import ShardLayout
from disttrain.metrics.logger import MetricsLogger, read_metrics
from disttrain.metrics.summary import Outcome
from disttrain.metrics.time_to_target import Evaluation, TimeToTarget, time_to_target
from disttrain.metrics.window import MetricsWindow, TrainClock
from disttrain.training.checkpoints import Position
from disttrain.training.engine import EvalResult, StepResult
from disttrain.training.loading import PrefetchedBatches
from disttrain.training.rebalance import Rebalancer
from disttrain.training.strategy import CheckpointStore, Participant, StepInfo

logger = logging.getLogger(__name__)

LOOP_KEYS = ("strategy", "position", "sampler", "rng")


class StopRequest(Protocol):
    """Whether to stop now (a `threading.Event` a SIGTERM handler sets, or an agreement of
    every process's flag). Asked at the same points on every process of a run, once each:
    every step's end but an epoch's last, and every epoch's end but the run's last; so an
    agreement may be a collective."""

    def is_set(self) -> bool: ...


class ProgressDisplay(Protocol):
    def update(self, n: int = 1, **postfix: float) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class LoopSettings:
    """The loop's cadence, from the config's training section, and the record of what
    runs (the resolved config, written beside the metrics and into every checkpoint)."""

    num_epochs: int
    batch_size: int
    log_interval: int
    checkpoint_interval: int
    micro_batches: int = 1  # batches per step (gradient accumulation)
    record: Mapping[str, Any] = field(default_factory=dict, compare=False)
    task: str = "classification"  # the data set's: a language model logs perplexity, not accuracy
    # A data set read by shards (`shards:`): the sampler orders by them, the reader reads ahead.
    shards: ShardLayout | None = field(default=None, compare=False)

    @classmethod
    def of(cls, training: TrainingConfig, record: Mapping[str, Any], micro_batches: int = 1) -> LoopSettings:
        return cls(training.num_epochs, training.batch_size, training.log_interval,
                   training.checkpoint_interval, micro_batches, record, describe_dataset(training).task,
                   shard_layout(training))

    @property
    def perplexity(self) -> bool:
        return self.task == LANGUAGE_MODEL

    @property
    def target(self) -> TimeToTarget:
        """The test figure whose time to each target the run records."""
        return time_to_target(self.perplexity)


@dataclass
class LoopResult:
    """Where the run ended and its final evaluation.

    `evaluations` holds `(train_time_s, figure)` of every epoch-end evaluation of the run
    in order, those made before a resume included (read back from `metrics.jsonl`): the
    figure is test accuracy, a language model's test perplexity; what the summary's time
    to accuracy (or perplexity) is computed from.
    """

    position: Position
    evaluation: EvalResult
    resumed_from_step: int | None
    evaluations: list[Evaluation] = field(default_factory=list)
    task: str = "classification"

    @property
    def outcome(self) -> Outcome:
        """The final evaluation and every evaluation on the way, as a run summary takes them."""
        return Outcome(self.evaluation.accuracy, self.evaluation.loss, tuple(self.evaluations), self.task)


def groups(batches: Iterator[torch.Tensor], size: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive batches grouped by `size`; the epoch's last group may be shorter."""
    group: list[torch.Tensor] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def window_record(window: MetricsWindow, clock_s: float, samples: int) -> dict[str, float]:
    """A training record: the window's figures at training-clock reading `clock_s`, the
    samples this process trained on so far, and that reading. Every strategy and recovery
    mode logs its windows through this, so they all log the same keys."""
    return {**window.scalars(clock_s), "progress/samples": samples, "progress/train_time_s": clock_s}


def evaluation_record(result: EvalResult, task: str, eval_s: float, samples: int,
                      train_time_s: float) -> dict[str, float]:
    """An epoch-end evaluation record: the test figures of the data set's `task`, the
    evaluation's seconds (off the training clock), the samples trained on so far and the
    training clock's reading. Every strategy and recovery mode logs evaluations through this."""
    return {**result.figures(task), "time/eval_s": eval_s, "progress/samples": samples,
            "progress/train_time_s": train_time_s}


def evaluate_off_the_clock(clock: TrainClock, faults: FaultInjector,
                           evaluate: Callable[[], EvalResult]) -> tuple[EvalResult, float]:
    """Run `evaluate` (an epoch's evaluation; the faults meant for evaluations first) with the
    training clock stopped. Returns its result and seconds. Every strategy and recovery mode
    evaluates through this, so none counts evaluation as training."""
    with clock.paused():
        started = time.perf_counter()
        faults.at_evaluation()
        result = evaluate()
        return result, time.perf_counter() - started


@dataclass
class LoopRecords:
    """The records a training process logs, kept once for every strategy and recovery mode
    (the shared loop's, and a live DDP rank's generations): the window of training figures
    every `log_interval` steps, each epoch's evaluation record with its announcement, and
    the `(train_time_s, figure)` evaluations the run's time to target is computed from.

    Args:
        metrics: this process's metrics stream.
        task: the data set's (a language model's records show perplexity, not accuracy).
        log_interval: steps between two window records.
        num_epochs: the run's; a record made after the last epoch ended is that epoch's.
        announce: log each epoch's test figures (the process that speaks for the run).
        on_metrics: called with (step, epoch, scalars) of every record logged; it runs on
            the training thread, so it must return at once.
        evaluations: those of the run so far (a resumed run's, read back from its records).
    """

    metrics: MetricsLogger
    task: str
    log_interval: int
    num_epochs: int
    announce: bool = True
    on_metrics: Callable[[int, int, Mapping[str, float]], None] | None = None
    evaluations: list[Evaluation] = field(default_factory=list)
    window: MetricsWindow = field(init=False)

    def __post_init__(self) -> None:
        self.window = MetricsWindow(0.0, self.perplexity)

    @property
    def perplexity(self) -> bool:
        return self.task == LANGUAGE_MODEL

    def open_window(self, clock_s: float) -> None:
        """Start a window at training-clock reading `clock_s`, dropping the steps of an open
        one (a live group's steps cut short by a change of group are redone)."""
        self.window = MetricsWindow(clock_s, self.perplexity)

    def after_step(self, step: int, epoch: int, result: StepResult, samples: int, clock_s: float) -> None:
        """Count step `step` (done at clock reading `clock_s`, `samples` trained on so far);
        log the window when the step ends one."""
        self.window.add(result.loss, result.num_correct, result.num_samples, result.scalars)
        if step % self.log_interval == 0:
            self.close_window(step, epoch, samples, clock_s)

    def close_window(self, step: int, epoch: int, samples: int, clock_s: float) -> None:
        """Log the open window's steps (if any) and open the next one at `clock_s`."""
        if self.window.num_steps:
            self.log(step, epoch, window_record(self.window, clock_s, samples))
        self.open_window(clock_s)

    def evaluated(self, step: int, epoch: int, result: EvalResult, eval_s: float, samples: int,
                  train_time_s: float) -> None:
        """Log the evaluation at `epoch`'s end (`eval_s` seconds, off the training clock,
        whose reading is `train_time_s`), count it among `evaluations` and announce it."""
        record = evaluation_record(result, self.task, eval_s, samples, train_time_s)
        self.evaluations.append((train_time_s, record[time_to_target(self.perplexity).metric]))
        self.log(step, epoch, record)
        self.metrics.flush()
        if self.announce and self.perplexity:
            logger.info("epoch %d: test perplexity %.3f, test loss %.4f (%.2fs)", epoch,
                        result.perplexity, result.loss, eval_s)
        elif self.announce:
            logger.info("epoch %d: test accuracy %.4f, test loss %.4f (%.2fs)", epoch, result.accuracy,
                        result.loss, eval_s)

    def log(self, step: int, epoch: int, scalars: dict[str, float]) -> None:
        epoch = min(epoch, self.num_epochs - 1)  # a record after the last epoch ended is that epoch's
        self.metrics.log(step, epoch, scalars)
        if self.on_metrics is not None:
            self.on_metrics(step, epoch, scalars)


@dataclass
class TrainingLoop:
    """Runs a participant from its checkpoint (or the start) to the last epoch.

    Args:
        settings: the loop's cadence and the record of the run's config.
        participant: the strategy's step, evaluation and checkpoint pieces.
        sampler: this process's shard of the training set.
        store: where this process's checkpoints are.
        metrics_folder: this process's metrics folder (`<log_dir>/<process>`).
        faults: the faults meant for this process.
        progress: makes the progress display from (total steps, steps already done).
        announce: log each epoch's test figures (the process that speaks for the run).
        config_path: where to write the resolved config once the run is sure to start.
        rebalancer: re-plans the split of the global batches as speeds drift (a balanced
            run; a collective every `system.balance_interval` steps).
        on_metrics: called with (step, epoch, scalars) of every record logged (a window's
            training figures, an evaluation's test figures), e.g. to report the latest to
            the coordinator; it runs on the training thread, so it must return at once.
        loader: the participant's training batches loaded ahead by worker processes
            (`training.loader_workers`): told each epoch's batches from a copy of the
            sampler, and closed when the run ends.
    """

    settings: LoopSettings
    participant: Participant
    sampler: ShardedSampler | PlannedSampler
    store: CheckpointStore
    metrics_folder: Path
    faults: FaultInjector
    progress: Callable[[int, int], ProgressDisplay]
    announce: bool = True
    config_path: Path | None = None
    rebalancer: Rebalancer | None = None
    on_metrics: Callable[[int, int, Mapping[str, float]], None] | None = None
    loader: PrefetchedBatches | None = None
    # Set (by a SIGTERM handler) to stop at the next step's end with a checkpoint of that
    # step (`Preempted`); a step that ends an epoch stops after its evaluation and checkpoint.
    stop_requested: StopRequest | None = None
    # A straggler fault (`faults.at_step`'s `slow`) slows a step's waits for peers too, not
    # only the process's own work (a live DDP group: its run then outlasts a restarted
    # rank's start-up in the tests).
    slows_waits: bool = False
    position: Position = field(default_factory=Position)
    clock: TrainClock = field(default_factory=TrainClock)

    def __post_init__(self) -> None:
        if self.settings.shards is not None:  # before a checkpoint's position is read into it
            self.sampler.read_by_shards(self.settings.shards.shard_sizes)

    def run(self, resume: bool) -> LoopResult:
        """Train to the end. Raises CheckpointError when the chosen checkpoint does not fit."""
        s, position, sampler = self.settings, self.position, self.sampler
        resumed_from = self.store.choose(resume)
        if resumed_from is not None:
            self._restore(resumed_from)
        if self.config_path is not None:
            write_config(self.settings.record, self.config_path)
        self.clock = TrainClock(position.train_time_s)
        metrics = MetricsLogger(self.metrics_folder,
                                resume_step=position.step if resumed_from is not None else None)
        # The evaluations a resume keeps are the records the logger kept: those up to its step.
        try:
            evaluations = ([] if resumed_from is None
                           else s.target.evaluations_from_records(read_metrics(metrics.path)))
        except ValueError as e:
            raise CheckpointError(f"{metrics.path}: {e}; the run's times to target cannot be kept across "
                                  "the resume: restore the file, or start the run afresh") from e
        steps_per_epoch = math.ceil(sampler.num_batches(s.batch_size) / s.micro_batches)
        display = self.progress(steps_per_epoch * s.num_epochs, position.step)
        records = LoopRecords(metrics, s.task, s.log_interval, s.num_epochs, self.announce, self.on_metrics,
                              evaluations)
        evaluation = self.train(records, display)
        self.clock.stop()
        display.close()
        if self.loader is not None:
            self.loader.close()
        records.close_window(position.step, position.epoch, position.samples_processed, self.clock.elapsed())
        if evaluation is None:  # resumed a finished run: nothing left to train
            evaluation = self.participant.evaluate(position.epoch - 1)
        if position.step % s.checkpoint_interval != 0:
            self._save(metrics)
        position.train_time_s = self.clock.elapsed()
        metrics.close()
        resumed_step = None if resumed_from is None else ckpt.checkpoint_step(resumed_from)
        return LoopResult(position, evaluation, resumed_step, evaluations, s.task)

    def train(self, records: LoopRecords, display: ProgressDisplay | None = None) -> EvalResult | None:
        """Train from the loop's position (the participant and the sampler at it) to the
        last epoch's end, logging into `records`: `run` calls it once, after a resume's
        restore; a live DDP rank once per generation of its group, from the state the
        generation's members synced. Returns the last epoch's evaluation (None: nothing
        was left to train).

        Raises:
            Preempted: asked to stop (`stop_requested`).
            Exception: whatever the participant's step or evaluation raises (a live
                group's change of members ends a generation's run so).
        """
        s, position, sampler = self.settings, self.position, self.sampler
        metrics, evaluation = records.metrics, None
        self.participant.start()
        self.clock.start()
        records.open_window(self.clock.elapsed())
        for epoch in range(position.epoch, s.num_epochs):
            sampler.set_epoch(epoch)
            position.epoch = epoch
            first = sampler.next_index(s.batch_size) // s.micro_batches
            save_after_evaluation = False
            if self.rebalancer is not None:
                self.rebalancer.at_epoch_start(position.step, epoch)
            if self.loader is not None:  # read ahead on a copy: the sampler's position is the steps'
                self.loader.start_epoch(lambda: list(copy.deepcopy(sampler).batches(s.batch_size)))
            if s.shards is not None:
                s.shards.read_ahead(list(copy.deepcopy(sampler).batches(s.batch_size)))
            for index, batches in enumerate(groups(sampler.batches(s.batch_size), s.micro_batches),
                                            start=first):
                # The sampler hands out a step's batches before the step: exhausted now is
                # the epoch's last step.
                result = self.participant.step(batches, StepInfo(position.step + 1, epoch, index,
                                                                 sampler.exhausted))
                position.step += 1
                position.samples_processed += result.num_samples
                if display is not None:
                    display.update(1, loss=result.loss)
                blocked_s = result.scalars.get("time/comm_blocked_s", 0.0)
                if self.rebalancer is not None:  # before a checkpoint, which then holds its plan
                    self.rebalancer.after_step(position.step, epoch, result.num_samples, blocked_s)
                records.after_step(position.step, epoch, result, position.samples_processed,
                                   self.clock.elapsed())
                if position.step % s.checkpoint_interval == 0:
                    if not sampler.exhausted:
                        self._save(metrics)
                    else:
                        save_after_evaluation = True
                self.faults.at_step(position.step, train_time_s=self.clock.elapsed(),
                                    waited_s=0.0 if self.slows_waits else blocked_s)
                if not sampler.exhausted:
                    self._stop_if_asked(metrics, saved=position.step % s.checkpoint_interval == 0)
            evaluation = self._evaluate(records, epoch)
            position.epoch = epoch + 1
            sampler.set_epoch(epoch + 1)
            if save_after_evaluation:
                self._save(metrics)
            if epoch + 1 < s.num_epochs:
                self._stop_if_asked(metrics, saved=save_after_evaluation)
        return evaluation

    def _evaluate(self, records: LoopRecords, epoch: int) -> EvalResult:
        """Evaluate off the training clock; log the figures with the clock's reading (so a
        report plots accuracy against training time from the JSONL alone)."""
        result, seconds = evaluate_off_the_clock(self.clock, self.faults,
                                                 lambda: self.participant.evaluate(epoch))
        records.evaluated(self.position.step, epoch, result, seconds, self.position.samples_processed,
                          self.clock.elapsed())
        return result

    def _stop_if_asked(self, metrics: MetricsLogger, saved: bool) -> None:
        """Stop here, with a checkpoint of this step (`saved`: already written), when asked.

        Raises:
            Preempted: asked to stop (the process's exit says so, code 143).
        """
        if self.stop_requested is None or not self.stop_requested.is_set():
            return
        if not saved:
            self._save(metrics)
        metrics.close()
        step = self.position.step
        raise Preempted(f"stopped by SIGTERM after step {step}, with its checkpoint "
                        f"({ckpt.checkpoint_name(step)}); run the same command with --resume to go on")

    def _save(self, metrics: MetricsLogger) -> None:
        with self.clock.paused():
            self.position.train_time_s = self.clock.elapsed()
            metrics.flush()  # the records a resume from this checkpoint keeps are on disk
            state: dict[str, Any] = {
                "strategy": self.participant.strategy,
                "position": self.position.state_dict(),
                "sampler": self.sampler.state_dict(),
                "rng": ckpt.rng_state(),
                "config": dict(self.settings.record),
                **self.participant.state_dict(),
            }
            self.store.save(self.position.step, state)

    def _restore(self, path: Path) -> None:
        state = self.store.load(path)
        ckpt.require_keys(state, ("strategy",), path)
        if state["strategy"] != self.participant.strategy:
            raise CheckpointError(f"checkpoint {path} was written by {state['strategy']!r}, not "
                                  f"{self.participant.strategy!r}; use another --checkpoint-dir")
        ckpt.require_keys(state, LOOP_KEYS, path)
        try:
            self.participant.load_state_dict(state)
            self.sampler.load_state_dict(state["sampler"])
            self.position.load_state_dict(state["position"])
        except (RuntimeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path} does not fit this run: {first}") from e
        ckpt.set_rng_state(state["rng"])
        logger.info("resumed from %s (epoch %d, step %d)", path, self.position.epoch, self.position.step)
