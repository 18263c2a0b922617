"""The records every training process logs (`training.loop.LoopRecords`) and its evaluation
off the training clock (`evaluate_off_the_clock`): the shared loop and a live DDP rank's
generations both go through them, so their cadence, keys, epoch of a record made after the
last epoch, the figure the time to target reads, and the stopped clock are checked once."""

from __future__ import annotations

import logging
import math

from disttrain.core.fault_spec import parse_fault
from disttrain.core.faults import FaultInjector
from disttrain.data import LANGUAGE_MODEL
from disttrain.metrics.logger import MetricsLogger, read_metrics
from disttrain.metrics.window import TrainClock
from disttrain.training.engine import EvalResult, StepResult
from disttrain.training.loop import LoopRecords, evaluate_off_the_clock


def records(tmp_path, task: str = "classification", **kwargs) -> LoopRecords:
    return LoopRecords(MetricsLogger(tmp_path, tensorboard=False), task, log_interval=2, num_epochs=1,
                       **kwargs)


def test_a_window_every_log_interval_steps_and_the_rest_when_closed(tmp_path):
    seen = []
    keeper = records(tmp_path, on_metrics=lambda step, epoch, scalars: seen.append(step))
    keeper.open_window(0.0)
    for step in range(1, 6):
        keeper.after_step(step, 0, StepResult(0.5, 3, 4, {"time/comm_blocked_s": 0.1}), 4 * step, float(step))
    keeper.close_window(5, 1, 20, 5.0)  # after the last epoch: its records are the last epoch's
    keeper.close_window(5, 1, 20, 5.0)  # nothing open: nothing logged
    keeper.metrics.close()
    logged = read_metrics(keeper.metrics.path)
    assert [r["step"] for r in logged] == [2, 4, 5] == seen
    assert [r["epoch"] for r in logged] == [0, 0, 0]
    assert [r["progress/samples"] for r in logged] == [8, 16, 20]
    assert logged[0]["time/comm_blocked_s"] == 0.1 and logged[0]["accuracy/train"] == 0.75


def test_a_dropped_window_is_not_logged(tmp_path):
    keeper = records(tmp_path)
    keeper.open_window(0.0)
    keeper.after_step(1, 0, StepResult(0.5, 3, 4), 4, 1.0)
    keeper.open_window(1.5)  # a live group re-formed: the step is redone, and counted then
    keeper.after_step(2, 0, StepResult(0.5, 3, 4), 8, 2.0)
    keeper.metrics.close()
    [logged] = read_metrics(keeper.metrics.path)
    assert logged["progress/train_time_s"] == 2.0 and logged["accuracy/train"] == 0.75


def test_an_evaluation_is_logged_and_counted_by_its_task_figure(tmp_path):
    result = EvalResult(loss_sum=20.0, num_correct=5, num_samples=2, num_predictions=10)
    classifier = records(tmp_path / "c", evaluations=[(0.5, 0.1)])
    classifier.evaluated(3, 0, result, 0.25, 12, 3.0)
    assert classifier.evaluations == [(0.5, 0.1), (3.0, 0.5)]
    model = records(tmp_path / "lm", task=LANGUAGE_MODEL)
    model.evaluated(3, 0, result, 0.25, 12, 3.0)
    assert model.evaluations == [(3.0, math.exp(2.0))]
    for keeper, key in ((classifier, "accuracy/test"), (model, "perplexity/test")):
        keeper.metrics.close()
        [logged] = read_metrics(keeper.metrics.path)
        assert key in logged and logged["time/eval_s"] == 0.25 and logged["progress/train_time_s"] == 3.0


def test_an_evaluation_runs_off_the_training_clock_with_its_faults(caplog):
    now = [10.0]
    clock = TrainClock(5.0, now=lambda: now[0])
    clock.start()
    now[0] = 12.0  # two seconds of training

    def evaluate() -> EvalResult:
        now[0] += 30.0  # the evaluation's thirty: not training
        return EvalResult(1.0, 1, 2)

    faults = FaultInjector([parse_fault("slow-eval:rank=1:for=1ms")], "rank", 1)
    with caplog.at_level(logging.WARNING, logger="disttrain.core.faults"):
        result, seconds = evaluate_off_the_clock(clock, faults, evaluate)
    assert result.accuracy == 0.5 and seconds >= 0.0
    assert clock.elapsed() == 7.0  # 5 restored + 2 trained
    assert "evaluation slowed" in caplog.text  # the fault meant for evaluations ran inside it
    now[0] += 1.0
    assert clock.elapsed() == 8.0  # running again
