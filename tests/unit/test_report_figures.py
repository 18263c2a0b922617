"""Report figures from real run folders: speed-up and scaling efficiency over the
baseline, time to each accuracy (a language model's: each perplexity) on the training
clock, rankings (unreached targets, failed runs), bytes on the wire per step, the
step-time split."""

import json

import pytest
from run_folders import (
    BASELINE,
    DDP,
    DDP_TOPK,
    LM_RUNS,
    PS_SYNC,
    RUNS,
    STEPS_PER_EPOCH,
    THRESHOLDS,
    FakeRun,
    write_run,
)

from disttrain.core.errors import InputFileError
from disttrain.metrics.time_to_target import ACCURACY, PERPLEXITY
from disttrain.report.figures import add_speedups, rankings, run_row
from disttrain.report.runs import evaluations, load_run

pytestmark = pytest.mark.timeout(60)


def expected_time(run: FakeRun, threshold: float) -> float | None:
    """The training clock at the end of the first epoch whose accuracy reaches `threshold`
    (a language model's perplexity: falls to it)."""
    for epoch, figure in enumerate(run.figures):
        if (figure <= threshold) if run.language_model else (figure >= threshold):
            return run.clock_at((epoch + 1) * STEPS_PER_EPOCH)
    return None


def rows_of(tmp_path, runs: dict[str, FakeRun], failed: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    for name, run in runs.items():
        write_run(tmp_path / name, run)
        entry = {"name": name, "strategy": run.strategy, "workers": len(run.processes), "status": "ok",
                 "log_dir": name}
        rows.append(run_row(entry, load_run(tmp_path / name), THRESHOLDS))
    for name in failed:
        rows.append(run_row({"name": name, "strategy": name, "workers": 2, "status": "failed",
                             "error": "exit code 1"}, None, THRESHOLDS))
    return rows


def test_speedup_and_efficiency_are_samples_per_second_over_the_baseline(tmp_path):
    rows = rows_of(tmp_path, RUNS)
    base = add_speedups(rows)
    assert base["name"] == "baseline"
    by_name = {row["name"]: row for row in rows}
    for name, run in RUNS.items():
        row = by_name[name]
        assert row["samples_per_s"] == pytest.approx(run.samples_per_s)
        assert row["speedup"] == pytest.approx(run.samples_per_s / BASELINE.samples_per_s)
        assert row["scaling_efficiency"] == pytest.approx(row["speedup"] / len(run.processes))
    assert by_name["baseline"]["speedup"] == pytest.approx(1.0)


def test_without_a_finished_baseline_there_is_no_speedup(tmp_path):
    rows = rows_of(tmp_path, {"ps-sync": PS_SYNC, "ddp": DDP}, failed=("baseline",))
    assert add_speedups(rows) is None
    assert all(row["speedup"] is None and row["scaling_efficiency"] is None for row in rows)


def test_time_to_accuracy_is_the_training_clock_at_the_first_evaluation_reaching_it(tmp_path):
    rows = rows_of(tmp_path, RUNS)
    for row, run in zip(rows, RUNS.values(), strict=True):
        expected = {ACCURACY.key(t): expected_time(run, t) for t in THRESHOLDS}
        assert row["time_to_accuracy_s"] == pytest.approx(expected)
    # from the summary (ps-sync), from evaluations placed between windows (baseline) and
    # from evaluations carrying the clock (ddp)
    assert {name for name, run in RUNS.items() if not run.summary_times} == {"baseline", "ddp"}
    assert not BASELINE.eval_clock and DDP.eval_clock


def test_the_summary_recorded_time_to_accuracy_wins(tmp_path):
    write_run(tmp_path / "run", BASELINE)
    summary_path = tmp_path / "run" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["time_to_accuracy_s"] = {"0.90": 0.123, "0.95": None}
    summary_path.write_text(json.dumps(summary))
    row = run_row({"name": "b", "status": "ok"}, load_run(tmp_path / "run"), THRESHOLDS)
    assert row["time_to_accuracy_s"] == {"0.90": 0.123, "0.95": None, "0.97": None, "0.98": None}


def test_evaluations_between_or_after_windows_are_placed_on_the_clock():
    records = [{"step": 10, "loss/train": 1.0, "progress/train_time_s": 1.0},
               {"step": 15, "accuracy/test": 0.5},
               {"step": 20, "loss/train": 1.0, "progress/train_time_s": 3.0},
               {"step": 23, "accuracy/test": 0.6},
               {"step": 24, "accuracy/test": 0.7, "progress/train_time_s": 9.0}]
    assert [e.train_time_s for e in evaluations(records)] == pytest.approx([2.0, 3.6, 9.0])


def test_rankings_put_reached_runs_first_fastest_first_and_leave_failed_runs_out(tmp_path):
    rows = rows_of(tmp_path, RUNS, failed=("ps-async",))
    add_speedups(rows)
    ranked = rankings(rows, ACCURACY.with_targets(THRESHOLDS))
    for threshold in THRESHOLDS:
        reached = sorted((name for name, run in RUNS.items() if expected_time(run, threshold) is not None),
                         key=lambda name, t=threshold: expected_time(RUNS[name], t))
        missed = sorted((name for name, run in RUNS.items() if expected_time(run, threshold) is None),
                        key=lambda name: -RUNS[name].accuracies[-1])
        assert ranked["time_to_accuracy"][ACCURACY.key(threshold)] == reached + missed
    assert ranked["time_to_accuracy"]["0.98"] == ["ddp", "baseline", "ddp+topk", "ps-sync"]  # none reached it
    assert ranked["samples_per_s"] == sorted(RUNS, key=lambda name: -RUNS[name].samples_per_s)
    assert "ps-async" not in ranked["samples_per_s"]
    failed = rows[-1]
    assert failed["status"] == "failed" and failed["error"] == "exit code 1" and failed["speedup"] is None


def test_a_language_models_time_to_perplexity_and_its_rankings(tmp_path):
    rows = rows_of(tmp_path, LM_RUNS)
    for row, run in zip(rows, LM_RUNS.values(), strict=True):
        assert row["time_to_perplexity_s"] == pytest.approx(
            {PERPLEXITY.key(t): expected_time(run, t) for t in PERPLEXITY.targets})
        assert row["final_perplexity"] == pytest.approx(run.perplexities[-1])
        assert row["time_to_accuracy_s"] == dict.fromkeys(map(ACCURACY.key, THRESHOLDS))
        assert [point["perplexity"] for point in row["series"]["test"]] == pytest.approx(run.perplexities)
        assert all(point["accuracy"] is None for point in row["series"]["test"])
    # from the summary (baseline, ddp) and from the metrics (ps-sync's summary has none)
    assert [run.summary_times for run in LM_RUNS.values()] == [True, False, True]
    assert rows[0]["time_to_perplexity_s"] == pytest.approx({"32": 0.8, "16": 0.8, "8": 1.2, "4": None})
    ranked = rankings(rows, PERPLEXITY)
    assert set(ranked) == {"time_to_perplexity", "samples_per_s"}
    assert ranked["time_to_perplexity"]["32"] == ["ddp", "baseline", "ps-sync"]  # 0.3s, 0.8s, 1.0s
    assert ranked["time_to_perplexity"]["8"] == ["baseline", "ddp", "ps-sync"]  # then lowest final (9, 17)
    assert ranked["time_to_perplexity"]["4"] == ["baseline", "ddp", "ps-sync"]  # none reached it: 7.5, 9, 17


def test_bytes_per_step_step_split_compression_and_recovery(tmp_path):
    rows = {row["name"]: row for row in rows_of(tmp_path, RUNS)}
    ps_bytes = PS_SYNC.scalars["comm/bytes_sent"] + PS_SYNC.scalars["comm/bytes_received"]
    assert rows["ps-sync"]["bytes_per_step"] == pytest.approx(ps_bytes)
    assert rows["ddp"]["bytes_per_step"] == pytest.approx(DDP.scalars["comm/bytes_allreduced"])
    assert rows["ddp+topk"]["bytes_per_step"] == pytest.approx(DDP_TOPK.scalars["compression/bytes_sent"])
    assert rows["baseline"]["bytes_per_step"] == 0
    for name, run in RUNS.items():
        split = rows[name]["step_time"]
        assert split["step_s"] == pytest.approx(run.step_s)
        assert split["compute_s"] == pytest.approx(run.step_s - run.comm_s)
        assert (split["comm_blocked_s"] or 0.0) == pytest.approx(run.comm_s)
    assert rows["ddp+topk"]["step_time"]["compression_s"] == pytest.approx(0.002)
    assert rows["ddp+topk"]["compression_ratio"] == 50.0 and rows["ddp"]["compression_ratio"] is None
    assert rows["ps-sync"]["recovery_events"] == 1 and rows["ddp"]["recovery_events"] == 0
    assert rows["ps-sync"]["staleness_histogram"] == {"0": 50, "1": 10}
    assert rows["ddp"]["staleness_histogram"] is None


@pytest.mark.parametrize("content, fragment", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not a run summary"),
    ('{"strategy": "ddp"}', "missing final_accuracy"),
])
def test_a_bad_run_summary_names_the_file(tmp_path, content, fragment):
    (tmp_path / "run").mkdir()
    if content is not None:
        (tmp_path / "run" / "summary.json").write_text(content)
    with pytest.raises(InputFileError, match=fragment) as caught:
        load_run(tmp_path / "run")
    assert str(tmp_path / "run" / "summary.json") in str(caught.value)
    assert caught.value.exit_code == 2


def test_a_ps_row_shows_pull_bytes_beside_push_bytes(tmp_path):
    from disttrain.report.table import markdown_table

    rows = {row["name"]: row for row in rows_of(tmp_path, RUNS)}
    ps = rows["ps-sync"]
    assert ps["push_bytes_per_step"] == pytest.approx(PS_SYNC.scalars["comm/bytes_sent"])
    assert ps["pull_bytes_per_step"] == pytest.approx(PS_SYNC.scalars["comm/bytes_received"])
    assert rows["ddp"]["pull_bytes_per_step"] is None and ps["compression_pull_ratio"] is None
    pulled = {**ps, "name": "ps-pull", "push_bytes_per_step": 2e6, "pull_bytes_per_step": 2e5,
              "compression_ratio": None, "compression_pull_ratio": 10.0}
    table = markdown_table([pulled, rows["ddp"]], ACCURACY.with_targets([]))
    assert "| 2.0 MB+200.0 KB | -/10.0x |" in table
    assert "+" not in next(line for line in table.splitlines() if line.startswith("| ddp |"))
