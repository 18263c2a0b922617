"""Metrics: JSONL records, TensorBoard events, resume truncation, the vocabulary, the
training clock, windows, summary files."""

import json
import math

import pytest
import torch
from conftest import REPO_ROOT
from event_files import assert_tensorboard_mirrors_jsonl, tensorboard_scalars

from disttrain.metrics import keys
from disttrain.metrics.logger import MetricsLogger, read_metrics
from disttrain.metrics.summary import Outcome, RunSummary, Work
from disttrain.metrics.window import MetricsWindow, StepTimer, TrainClock


class FakeTime:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path / "worker0") as metrics:
        metrics.log(10, 0, {"loss/train": 1.5, "time/compute_s": 0.01})
        metrics.log(20, 0, {"loss/train": float("nan")})
    records = read_metrics(tmp_path / "worker0" / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20]
    assert records[0]["loss/train"] == 1.5 and records[1]["loss/train"] is None
    assert {"epoch", "time"} <= set(records[0])
    assert list((tmp_path / "worker0").glob("events.out.tfevents.*"))


def test_tensorboard_reads_back_every_key_of_the_vocabulary(tmp_path):
    def value(index: int, step: int) -> float:
        return index + step / 7  # a different value for every key and step, not exact in float32

    with MetricsLogger(tmp_path) as metrics:
        for step in (5, 10, 15):
            metrics.log(step, step // 10, {key: value(i, step) for i, key in enumerate(keys.METRICS)})
        metrics.log(20, 2, {"loss/train": float("nan")})
    scalars = tensorboard_scalars(tmp_path)  # TensorBoard's own reader
    assert set(scalars) == set(keys.METRICS)
    for index, key in enumerate(keys.METRICS):
        points = scalars[key] if key != "loss/train" else scalars[key][:-1]
        assert points == [(step, torch.tensor(value(index, step), dtype=torch.float32).item())
                          for step in (5, 10, 15)], key
    assert scalars["loss/train"][-1][0] == 20 and math.isnan(scalars["loss/train"][-1][1])
    assert assert_tensorboard_mirrors_jsonl(tmp_path) == set(keys.METRICS)


def test_a_key_outside_the_vocabulary_is_refused(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        with pytest.raises(ValueError, match=r"\['samples'\] are not in"):
            metrics.log(1, 0, {"loss/train": 1.0, "samples": 64})
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_every_key_has_a_unit_kind_and_meaning():
    for metric in [*keys.METRICS.values(), *keys.SUMMARY.values()]:
        assert metric.unit and metric.meaning and metric.logged_by
        assert metric.kind in (keys.WINDOW, keys.PER_STEP, keys.CUMULATIVE, keys.EPOCH_END, keys.RUN)
    assert set(keys.SUMMARY) <= set(RunSummary.__dataclass_fields__)


def test_the_metrics_page_holds_the_vocabulary():
    assert keys.markdown() in (REPO_ROOT / "docs" / "metrics.md").read_text(), "run: make metrics-table"


def test_resume_drops_records_of_redone_steps(tmp_path):
    with MetricsLogger(tmp_path) as metrics:
        for step in (10, 20, 30):
            metrics.log(step, 0, {"loss/train": step})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 40, "loss/tr')  # a torn line from a killed process
    with MetricsLogger(tmp_path, resume_step=20) as metrics:
        metrics.log(30, 0, {"loss/train": 3.0})
    assert [(r["step"], r["loss/train"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (10, 10.0), (20, 20.0), (30, 3.0)]
    # TensorBoard drops the same records: the resume step's own record stays.
    assert tensorboard_scalars(tmp_path) == {"loss/train": [(10, 10.0), (20, 20.0), (30, 3.0)]}
    assert_tensorboard_mirrors_jsonl(tmp_path)


def test_clock_stops_while_paused():
    now = FakeTime(100.0)
    clock = TrainClock(elapsed_s=5.0, now=now)
    assert clock.elapsed() == 5.0  # starts stopped
    clock.start()
    now.now = 102.0
    with clock.paused():
        now.now = 150.0  # an evaluation
        assert clock.elapsed() == 7.0
    now.now = 151.0
    assert clock.elapsed() == 8.0
    clock.stop()
    now.now = 200.0
    assert clock.elapsed() == 8.0


def test_step_timer_drains_per_phase():
    now = FakeTime()
    timer = StepTimer(now=now)
    with timer.phase("comm_blocked"):
        now.now += 0.25
    assert timer.drain() == {"time/comm_blocked_s": 0.25}
    assert timer.drain() == {}


def test_window_figures_are_per_step_and_weighted_by_samples():
    window = MetricsWindow(clock_s=10.0)
    window.add(1.0, 3, 4, {"time/comm_blocked_s": 0.5, "comm/bytes_sent": 100})
    window.add(4.0, 1, 12, {"time/comm_blocked_s": 0.1, "comm/bytes_sent": 300})
    scalars = window.scalars(clock_s=12.0)
    assert scalars == pytest.approx({
        "loss/train": (4 * 1.0 + 12 * 4.0) / 16, "accuracy/train": 4 / 16,
        "throughput/samples_per_s": 8.0, "time/step_s": 1.0, "time/compute_s": 0.7,
        "time/comm_blocked_s": 0.3, "comm/bytes_sent": 200.0})
    assert window.num_steps == 2


def test_summary_throughput_is_samples_over_the_training_clock(tmp_path):
    from disttrain.config import config_from_dict

    summary = RunSummary.create("baseline", config_from_dict({}), Outcome(0.9, 0.3),
                                Work(samples_processed=6000, steps=100, world_size=1, total_time_s=12.0,
                                     train_time_s=4.0),
                                extra={"resumed_from_step": None})
    assert summary.throughput_samples_per_s == 1500.0
    path = summary.write(tmp_path / "logs" / "summary.json")
    data = json.loads(path.read_text())
    assert data["strategy"] == "baseline" and data["resumed_from_step"] is None
    assert set(keys.SUMMARY) <= set(data)
    assert RunSummary.read(tmp_path / "logs") == summary
    assert summary.lines()[1] == "Final Accuracy: 90.00%"
