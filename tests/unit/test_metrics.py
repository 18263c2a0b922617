"""Metrics: JSONL records, TensorBoard events, resume truncation, summary files."""

import json

from disttrain.metrics import MetricsLogger, RunSummary, StepTimer, TrainWindow, read_metrics


def test_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path / "worker0") as metrics:
        metrics.log(10, 0, {"loss/train": 1.5, "time/compute_s": 0.01})
        metrics.log(20, 0, {"loss/train": float("nan")})
    records = read_metrics(tmp_path / "worker0" / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20]
    assert records[0]["loss/train"] == 1.5 and records[1]["loss/train"] is None
    assert {"epoch", "time"} <= set(records[0])
    assert list((tmp_path / "worker0").glob("events.out.tfevents.*"))


def test_resume_drops_records_of_redone_steps(tmp_path):
    with MetricsLogger(tmp_path) as metrics:
        for step in (10, 20, 30):
            metrics.log(step, 0, {"loss/train": step})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 40, "loss/tr')  # a torn line from a killed process
    with MetricsLogger(tmp_path, resume_step=20, tensorboard=False) as metrics:
        metrics.log(30, 0, {"loss/train": 3.0})
    assert [(r["step"], r["loss/train"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (10, 10.0), (20, 20.0), (30, 3.0)]


def test_step_timer_drains_per_phase():
    timer = StepTimer()
    with timer.phase("compute"):
        sum(range(1000))
    with timer.phase("comm"):
        pass
    drained = timer.drain()
    assert set(drained) == {"time/compute_s", "time/comm_s"} and drained["time/compute_s"] > 0
    assert timer.drain() == {}


def test_summary_written_twice_with_required_fields(tmp_path):
    summary = RunSummary("baseline", "digits", 0.9, 0.3, 12.0, 500.0, 6000, 100, 2, 1,
                         {"training": {}}, extra={"train_time_s": 11.0})
    written = summary.write(tmp_path / "logs", tmp_path / "out" / "s.json")
    for path in written:
        data = json.loads(path.read_text())
        assert data["strategy"] == "baseline" and data["train_time_s"] == 11.0
        assert {"final_accuracy", "final_loss", "total_time_s", "throughput_samples_per_s",
                "samples_processed", "steps", "epochs", "world_size", "config"} <= set(data)
    assert summary.lines()[1] == "Final Accuracy: 90.00%"


def test_train_window_weights_loss_by_samples():
    window = TrainWindow(started=10.0)
    window.add(1.0, 3, 4)
    window.add(4.0, 1, 12)
    scalars = window.scalars(now=12.0)
    assert scalars == {"loss/train": (4 * 1.0 + 12 * 4.0) / 16, "accuracy/train": 4 / 16,
                       "throughput/samples_per_s": 8.0}
    assert window.num_steps == 2
