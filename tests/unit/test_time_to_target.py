"""Time to a target: the first-crossing rule over a run's evaluations (accuracy up to its
thresholds, a language model's perplexity down to its targets), the evaluations the
training loop records (in metrics.jsonl and its result), and a resume keeping those made
before it; every record the loop logs also goes to its metrics listener (what a node
reports to the coordinator)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from disttrain.config import config_from_dict
from disttrain.coordinator.reports import LatestMetrics
from disttrain.core.errors import CheckpointError
from disttrain.core.faults import FaultInjector
from disttrain.data import ShardedSampler
from disttrain.metrics.keys import ACCURACY_THRESHOLDS, PERPLEXITY_TARGETS
from disttrain.metrics.logger import read_metrics
from disttrain.metrics.time_to_target import ACCURACY, DOWN, PERPLEXITY, UP, first_reached
from disttrain.training.checkpoints import LocalCheckpoints
from disttrain.training.engine import EvalResult, StepResult
from disttrain.training.loop import LoopResult, LoopSettings, TrainingLoop
from disttrain.training.strategy import StepInfo


def test_keys_are_the_thresholds_with_two_decimals_and_the_perplexities_as_written():
    assert ACCURACY_THRESHOLDS == (0.90, 0.95, 0.97, 0.98)
    assert list(ACCURACY.times([])) == ["0.90", "0.95", "0.97", "0.98"]
    assert ACCURACY.key(0.9) == "0.90" and ACCURACY.label(0.9) == "90%"
    assert PERPLEXITY_TARGETS == (32.0, 16.0, 8.0, 4.0)
    assert list(PERPLEXITY.times([])) == ["32", "16", "8", "4"]
    assert PERPLEXITY.key(4.5) == "4.5" and PERPLEXITY.label(16.0) == "16"


def test_first_reached_crosses_upwards_or_downwards_at_or_past_the_target():
    rising = [(1.0, 0.5), (2.0, 0.9), (3.0, 0.95)]
    assert first_reached(rising, (0.9, 0.95, 0.99), UP) == [2.0, 3.0, None]  # reached means >=
    assert first_reached(rising, (0.9,), DOWN) == [1.0]  # 0.5 <= 0.9 already
    falling = [(1.0, 40.0), (2.0, 16.0), (3.0, 7.9)]
    assert first_reached(falling, (32.0, 16.0, 8.0, 4.0), DOWN) == [2.0, 2.0, 3.0, None]  # <=
    assert first_reached(falling, (32.0,), UP) == [1.0]
    assert first_reached([], (1.0,), UP) == [None]
    with pytest.raises(ValueError, match="direction should be"):
        first_reached(rising, (0.9,), "sideways")


def test_never_reached_is_none():
    assert ACCURACY.times([(1.0, 0.5), (2.0, 0.89999)]) == dict.fromkeys(["0.90", "0.95", "0.97", "0.98"])
    assert PERPLEXITY.times([(1.0, 256.0), (2.0, 32.0001)]) == dict.fromkeys(["32", "16", "8", "4"])


def test_reached_at_the_first_evaluation():
    assert ACCURACY.times([(1.5, 0.97), (3.0, 0.99)]) == {"0.90": 1.5, "0.95": 1.5, "0.97": 1.5,
                                                          "0.98": 3.0}
    assert PERPLEXITY.times([(1.5, 9.0), (3.0, 3.0)]) == {"32": 1.5, "16": 1.5, "8": 3.0, "4": 3.0}


def test_the_first_evaluation_reaching_a_target_counts_even_if_the_figure_worsens_after():
    found = ACCURACY.times([(1.0, 0.91), (2.0, 0.85), (3.0, 0.96), (4.0, 0.93)])
    assert found == {"0.90": 1.0, "0.95": 3.0, "0.97": None, "0.98": None}
    assert ACCURACY.with_targets([0.90]).times([(1.0, 0.90)]) == {"0.90": 1.0}
    found = PERPLEXITY.times([(1.0, 20.0), (2.0, 7.0), (3.0, 12.0), (4.0, 5.0)])
    assert found == {"32": 1.0, "16": 2.0, "8": 2.0, "4": None}  # 12 after 7 undoes nothing


def test_evaluations_from_records_take_those_with_a_figure_at_their_clock():
    records = [
        {"step": 5, "loss/train": 1.0, "progress/train_time_s": 0.5},  # a window, not an evaluation
        {"step": 10, "accuracy/test": 0.9, "progress/train_time_s": 1.25},
        {"step": 20, "accuracy/test": None, "progress/train_time_s": 2.5},  # non-finite, as null
        {"step": 30, "perplexity/test": 12.0, "progress/train_time_s": 3.5},
    ]
    assert ACCURACY.evaluations_from_records(records) == [(1.25, 0.9)]
    assert PERPLEXITY.evaluations_from_records(records) == [(3.5, 12.0)]


def test_an_evaluation_record_without_the_clock_is_refused_by_its_step():
    with pytest.raises(ValueError, match="step 10 has no progress/train_time_s"):
        ACCURACY.evaluations_from_records([{"step": 10, "accuracy/test": 0.8}])


# -- the loop ------------------------------------------------------------------------------

ACCURACY_BY_EPOCH = {0: 0.50, 1: 0.92, 2: 0.96, 3: 0.94}
PERPLEXITY_BY_EPOCH = {0: 40.0, 1: 20.0, 2: 6.0, 3: 10.0}  # test loss is log(perplexity)


class Crash(Exception):
    pass


class ScriptedParticipant:
    """Steps that compute nothing; evaluations with a scripted accuracy per epoch; a crash
    at step `crash_at` (a killed process, seen from the loop)."""

    strategy = "baseline"

    def __init__(self, crash_at: int | None = None):
        self.crash_at = crash_at

    def start(self) -> None:
        pass

    def step(self, batches, info: StepInfo) -> StepResult:
        if info.step == self.crash_at:
            raise Crash(f"crash at step {info.step}")
        return StepResult(loss=1.0, num_correct=1, num_samples=len(batches[0]))

    def evaluate(self, epoch: int) -> EvalResult:
        return EvalResult(loss_sum=100 * math.log(PERPLEXITY_BY_EPOCH[epoch]),
                          num_correct=round(ACCURACY_BY_EPOCH[epoch] * 100), num_samples=100)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class NoDisplay:
    def update(self, n: int = 1, **postfix: float) -> None:
        pass

    def close(self) -> None:
        pass


def run_loop(tmp_path: Path, participant: ScriptedParticipant, resume: bool, on_metrics=None,
             task: str = "classification") -> LoopResult:
    # 8 samples in batches of 4: 2 steps an epoch; the checkpoint at step 4 ends epoch 1.
    config = config_from_dict({"training": {"num_epochs": 4, "batch_size": 4, "log_interval": 1,
                                            "checkpoint_interval": 4}})
    settings = dataclasses.replace(LoopSettings.of(config.training, config.to_dict()), task=task)
    loop = TrainingLoop(settings, participant, ShardedSampler(8, seed=0),
                        LocalCheckpoints(tmp_path / "ckpt", keep=2), tmp_path / "logs" / "baseline",
                        FaultInjector((), "worker"), lambda total, done: NoDisplay(), on_metrics=on_metrics)
    return loop.run(resume)


def test_the_loop_records_each_evaluation_with_the_training_clock(tmp_path):
    result = run_loop(tmp_path, ScriptedParticipant(), resume=False)
    records = read_metrics(tmp_path / "logs" / "baseline" / "metrics.jsonl")
    logged = [r for r in records if "accuracy/test" in r]
    assert [r["progress/samples"] for r in logged] == [8, 16, 24, 32]
    assert result.evaluations == [(r["progress/train_time_s"], r["accuracy/test"]) for r in logged]
    assert [accuracy for _, accuracy in result.evaluations] == [ACCURACY_BY_EPOCH[e] for e in range(4)]
    times = [t for t, _ in result.evaluations]
    assert times == sorted(times) and times[-1] <= result.position.train_time_s


def test_a_resume_keeps_the_evaluations_made_before_it(tmp_path):
    with pytest.raises(Crash):
        run_loop(tmp_path, ScriptedParticipant(crash_at=6), resume=False)  # in epoch 2
    before = ACCURACY.evaluations_from_records(read_metrics(tmp_path / "logs" / "baseline" / "metrics.jsonl"))
    assert [accuracy for _, accuracy in before] == [0.50, 0.92]

    result = run_loop(tmp_path, ScriptedParticipant(), resume=True)
    assert result.resumed_from_step == 4
    assert result.evaluations[:2] == before
    assert [accuracy for _, accuracy in result.evaluations] == [0.50, 0.92, 0.96, 0.94]
    times = [t for t, _ in result.evaluations]
    assert times == sorted(times)  # the resumed clock goes on from the checkpoint's
    found = ACCURACY.times(result.evaluations)
    assert found == {"0.90": before[1][0], "0.95": times[2], "0.97": None, "0.98": None}


def test_a_resume_whose_metrics_lost_an_evaluations_clock_names_the_file(tmp_path):
    with pytest.raises(Crash):
        run_loop(tmp_path, ScriptedParticipant(crash_at=6), resume=False)
    path = tmp_path / "logs" / "baseline" / "metrics.jsonl"
    records = read_metrics(path)
    for record in records:
        if "accuracy/test" in record:
            del record["progress/train_time_s"]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(CheckpointError, match=f"{path}: the evaluation record of step 2 has no "
                                              "progress/train_time_s.*start the run afresh"):
        run_loop(tmp_path, ScriptedParticipant(), resume=True)


def test_a_language_model_records_its_test_perplexity_and_a_resume_keeps_it(tmp_path):
    with pytest.raises(Crash):
        run_loop(tmp_path, ScriptedParticipant(crash_at=6), resume=False, task="language-model")
    records = read_metrics(tmp_path / "logs" / "baseline" / "metrics.jsonl")
    assert not any("accuracy/test" in r for r in records)
    before = PERPLEXITY.evaluations_from_records(records)
    assert [perplexity for _, perplexity in before] == pytest.approx([40.0, 20.0])

    result = run_loop(tmp_path, ScriptedParticipant(), resume=True, task="language-model")
    assert result.evaluations[:2] == before
    records = read_metrics(tmp_path / "logs" / "baseline" / "metrics.jsonl")
    logged = [r for r in records if "perplexity/test" in r]
    assert result.evaluations == [(r["progress/train_time_s"], r["perplexity/test"]) for r in logged]
    times = [t for t, _ in result.evaluations]
    assert PERPLEXITY.times(result.evaluations) == {"32": times[1], "16": times[2], "8": times[2], "4": None}


def test_every_record_the_loop_logs_goes_to_its_metrics_listener(tmp_path):
    heard: list[tuple[int, int, dict]] = []
    latest = LatestMetrics()

    def on_metrics(step: int, epoch: int, scalars) -> None:
        heard.append((step, epoch, dict(scalars)))
        latest.publish(step, epoch, scalars)

    run_loop(tmp_path, ScriptedParticipant(), resume=False, on_metrics=on_metrics)
    records = read_metrics(tmp_path / "logs" / "baseline" / "metrics.jsonl")
    assert heard == [(r.pop("step"), r.pop("epoch"), {k: v for k, v in r.items() if k != "time"})
                     for r in records]
    final = latest.latest()  # what a node's heartbeat thread reports last
    assert (final.step, final.epoch, final.scalars["accuracy/test"]) == (8, 3, ACCURACY_BY_EPOCH[3])
    assert final.scalars["loss/train"] == 1.0
