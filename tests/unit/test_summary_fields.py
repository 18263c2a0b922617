"""The run summary's time to accuracy, and a language model's time to perplexity (written,
read back, printed; a file without them refused in one line) and the hyper-parameters
written for TensorBoard's HPARAMS tab."""

from __future__ import annotations

import json

import pytest

from disttrain.config import config_from_dict
from disttrain.metrics import hparams
from disttrain.metrics.hparams import hparam_values, metric_values, read_hparams, write_hparams
from disttrain.metrics.summary import Outcome, RunSummary, Work


def make_summary(evaluations=(), strategy="baseline", extra=None, **config) -> RunSummary:
    return RunSummary.create(strategy, config_from_dict(config), Outcome(0.96, 0.2, tuple(evaluations)),
                             Work(samples_processed=4000, steps=60, world_size=1, total_time_s=9.0,
                                  train_time_s=4.0),
                             extra=extra or {"resumed_from_step": None})


def test_time_to_accuracy_is_written_and_read_back(tmp_path):
    summary = make_summary([(1.25, 0.93), (2.5, 0.955), (3.75, 0.96)])
    assert summary.time_to_accuracy_s == {"0.90": 1.25, "0.95": 2.5, "0.97": None, "0.98": None}
    summary.write(tmp_path)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["time_to_accuracy_s"] == {"0.90": 1.25, "0.95": 2.5, "0.97": None, "0.98": None}
    assert "time_to_accuracy_s" not in RunSummary.read(tmp_path).extra
    assert RunSummary.read(tmp_path) == summary
    assert "Time to accuracy: 90% 1.2s, 95% 2.5s, 97% -, 98% -" in summary.lines()


def test_a_summary_an_earlier_disttrain_wrote_is_refused_in_one_line(tmp_path):
    data = make_summary([(1.0, 0.99)]).to_dict()
    del data["time_to_accuracy_s"]  # written before summaries recorded it
    (tmp_path / "summary.json").write_text(json.dumps(data))
    expected = "not a run summary of this disttrain .it has no time_to_accuracy_s.; if an earlier disttrain"
    with pytest.raises(ValueError, match=expected + " wrote it, run it again") as info:
        RunSummary.read(tmp_path)
    assert "\n" not in str(info.value)


def test_a_language_models_summary_records_its_time_to_perplexity(tmp_path):
    summary = RunSummary.create("ddp", config_from_dict({}),
                                Outcome(0.4, 2.0, ((1.0, 60.0), (2.0, 18.0), (3.0, 7.39)), "language-model"),
                                Work(samples_processed=4000, steps=60, world_size=2, total_time_s=9.0,
                                     train_time_s=4.0))
    times = {"32": 2.0, "16": 3.0, "8": 3.0, "4": None}  # 60 reaches none; 7.39 is below 8
    assert summary.time_to_perplexity_s == times and summary.time_to_accuracy_s == {}
    summary.write(tmp_path)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["time_to_perplexity_s"] == times and data["time_to_accuracy_s"] == {}
    assert RunSummary.read(tmp_path) == summary and RunSummary.read(tmp_path).time_to_perplexity_s == times
    assert "Time to perplexity: 32 2.0s, 16 3.0s, 8 3.0s, 4 -" in summary.lines()
    assert not any(line.startswith("Time to accuracy") for line in summary.lines())
    figures = metric_values(summary)
    assert {k: v for k, v in figures.items() if k.startswith("hparam/time_to_")} == {
        "hparam/time_to_perplexity_32_s": 2.0, "hparam/time_to_perplexity_16_s": 3.0,
        "hparam/time_to_perplexity_8_s": 3.0}
    # A language model's summary written before it recorded the times: refused.
    del data["time_to_perplexity_s"]
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="it has no time_to_perplexity_s"):
        RunSummary.read(tmp_path)
    assert make_summary([(1.0, 0.99)]).time_to_perplexity_s == {}  # a classifier has none
    assert "time_to_perplexity_s" not in make_summary().to_dict()


def test_hparams_are_flat_scalars_from_the_config():
    summary = make_summary(training={"batch_size": 32, "learning_rate": 0.05, "optimizer": "sgd"})
    assert hparam_values(summary) == {
        "strategy": "baseline", "dataset": "digits", "model": "simplecnn", "batch_size": 32,
        "learning_rate": 0.05, "optimizer": "sgd", "world_size": 1, "seed": 42, "num_epochs": 1,
        "lr_schedule": "constant", "weight_decay": 0.0, "clip_grad_norm": 0.0, "precision": "none",
        "compression": "none"}
    ps = make_summary(strategy="ps-ssp", ps={"aggregation_mode": "ssp", "staleness": 3},
                      compression={"enabled": True, "type": "topk", "ratio": 0.05},
                      extra={"compression_ratio": 12.0, "compression_bytes_sent": 1000})
    assert {k: v for k, v in hparam_values(ps).items() if k in (
        "aggregation_mode", "staleness", "compression", "compression_topk_ratio")} == {
        "aggregation_mode": "ssp", "staleness": 3, "compression": "topk", "compression_topk_ratio": 0.05}


def test_metrics_leave_out_thresholds_never_reached():
    summary = make_summary([(1.5, 0.91)])
    assert metric_values(summary) == {
        "hparam/final_accuracy": 0.96, "hparam/final_loss": 0.2, "hparam/train_time_s": 4.0,
        "hparam/throughput_samples_per_s": 1000.0, "hparam/time_to_accuracy_0.90_s": 1.5}


def test_write_hparams_round_trip_and_a_rerun_replaces_the_earlier_session(tmp_path):
    write_hparams(make_summary([(1.5, 0.91)], training={"batch_size": 16}), tmp_path)
    folder = write_hparams(make_summary([(1.5, 0.91)], training={"batch_size": 32}), tmp_path)
    assert folder == tmp_path / "hparams"
    values, metrics = read_hparams(folder)
    assert values["batch_size"] == 32 and values["strategy"] == "baseline"
    assert set(metrics) == set(metric_values(make_summary([(1.5, 0.91)])))
    assert metrics["hparam/final_accuracy"] == pytest.approx(0.96)


def test_a_failure_to_write_hparams_is_a_warning_not_an_error(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(hparams, "HPARAMS_FOLDER", "blocked")
    (tmp_path / "blocked").write_text("a file where the folder goes")
    assert write_hparams(make_summary(), tmp_path) is None
    assert "could not write the hyper-parameters" in caplog.text


def test_pull_compression_is_printed_beside_the_bytes_pushed():
    summary = make_summary(strategy="ps-sync", compression={"pull": "topk"},
                           extra={"bytes_sent": 4_000_000, "bytes_received": 500_000,
                                  "compression_pull_ratio": 8.0, "compression_bytes_received": 500_000})
    assert "Pull Compression: 8.0x fewer bytes (0.5 MB received, 4.0 MB sent)" in summary.lines()
    assert not any(line.startswith("Pull") for line in make_summary().lines())
