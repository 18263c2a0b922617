"""Rendering a comparison folder: report.json with each run's series, PNG plots that
open, one self-contained HTML page with every plot inline, report.md, the text table; a
language models' comparison timed to perplexities in place of accuracies."""

import base64
import dataclasses
import json
import re

import pytest
from matplotlib.image import imread
from run_folders import BASELINE, DDP, LM_RUNS, PS_SYNC, RUNS, STEPS_PER_EPOCH, write_comparison

from disttrain.core.errors import InputFileError
from disttrain.report.render import render_comparison

pytestmark = pytest.mark.timeout(120)

ERROR = "exit code 1: worker 1 was killed"


def test_a_comparison_renders_json_plots_html_and_markdown(tmp_path):
    folder = write_comparison(tmp_path / "cmp", failed={"ps-async+topk": ERROR})
    rendered = render_comparison(folder)

    report = json.loads(rendered.json_path.read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == [*RUNS, "ps-async+topk"] and report["baseline"] == "baseline"
    for name, run in RUNS.items():
        series = runs[name]["series"]
        assert [point["accuracy"] for point in series["test"]] == run.accuracies
        assert [point["step"] for point in series["test"]] == [
            STEPS_PER_EPOCH * (epoch + 1) for epoch in range(len(run.accuracies))]
        assert [point["train_time_s"] for point in series["test"]] == pytest.approx(
            [run.clock_at(point["step"]) for point in series["test"]])
        assert len(series["train"]) == run.num_steps // 5 and series["process"] == run.processes[0]
    failed = runs["ps-async+topk"]
    assert failed["status"] == "failed" and failed["error"] == ERROR and failed["series"]["test"] == []
    assert "ps-async+topk" not in report["ranking"]["samples_per_s"]

    names = {path.name for path in rendered.plots}
    assert names == {"accuracy_vs_time.png", "loss_vs_step.png", "throughput.png", "step_time.png",
                     "bytes_per_step.png", "staleness.png"}
    assert report["plots"] == [f"plots/{path.name}" for path in rendered.plots]
    for path in rendered.plots:
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    html = rendered.html_path.read_text()
    inline = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(inline) == len(rendered.plots) == html.count("data:image/png;base64")
    assert sorted(base64.b64decode(data) for data in inline) == sorted(p.read_bytes() for p in rendered.plots)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
    assert "<script" not in html and "<link" not in html and "@import" not in html and "url(" not in html
    assert f"failed: {ERROR}" in html

    markdown = rendered.markdown_path.read_text()
    assert all(f"](plots/{path.name})" in markdown for path in rendered.plots)
    assert "| baseline | ok |" in markdown

    lines = rendered.table.splitlines()
    assert lines[0].split()[:3] == ["run", "status", "acc"]
    assert any(line.startswith("ps-async+topk") and f"failed: {ERROR}" in line for line in lines)
    assert max(len(line) for line in lines) <= 120
    baseline_line = next(line for line in lines if line.startswith("baseline "))
    assert f"{BASELINE.accuracies[-1] * 100:.2f}%" in baseline_line and "1.00x" in baseline_line


def test_a_language_models_comparison_shows_perplexity_and_the_time_to_each_target(tmp_path):
    folder = write_comparison(tmp_path / "cmp", runs=LM_RUNS)
    rendered = render_comparison(folder)
    report = json.loads(rendered.json_path.read_text())
    assert report["thresholds"] == [] and report["perplexity_targets"] == [32, 16, 8, 4]
    assert report["ranking"]["time_to_perplexity"]["32"] == ["ddp", "baseline", "ps-sync"]
    baseline = next(run for run in report["runs"] if run["name"] == "baseline")
    assert baseline["time_to_perplexity_s"] == pytest.approx({"32": 0.8, "16": 0.8, "8": 1.2, "4": None})

    lines = rendered.table.splitlines()
    assert lines[0].split()[:8] == ["run", "status", "ppl", "tppl32", "tppl16", "tppl8", "tppl4", "total"]
    assert "t90%" not in rendered.table and "tNN%" not in rendered.table
    assert "tpplN: training-clock" in rendered.table
    assert lines[1].split()[:7] == ["baseline", "ok", "7.500", "0.80s", "0.80s", "1.20s", "-"]
    markdown = rendered.markdown_path.read_text()
    assert "| run | status | ppl | tppl32 | tppl16 | tppl8 | tppl4 |" in markdown
    assert "- time to perplexity 32: ddp 0.30s, baseline 0.80s, ps-sync 1.00s" in markdown
    assert "- time to perplexity 4: none reached it" in markdown
    html = rendered.html_path.read_text()
    assert "<th>tppl16</th>" in html
    assert "time to perplexity 16: baseline 0.80s, ddp 0.90s; not reached: ps-sync" in html
    names = {path.name for path in rendered.plots}
    assert "perplexity_vs_time.png" in names and "accuracy_vs_time.png" not in names
    comparison = json.loads((folder / "comparison.json").read_text())
    comparison["perplexity_targets"] = [10, 0.5]
    (folder / "comparison.json").write_text(json.dumps(comparison))
    with pytest.raises(InputFileError, match=r"perplexity_targets should be a list of perplexities >= 1"):
        render_comparison(folder)


def test_rendering_again_drops_plots_with_nothing_to_show(tmp_path):
    folder = write_comparison(tmp_path / "cmp", runs={"baseline": BASELINE, "ps-sync": PS_SYNC})
    assert (folder / "plots" / "staleness.png") in render_comparison(folder).plots
    comparison = json.loads((folder / "comparison.json").read_text())
    comparison["runs"][1].update(status="failed", error="killed")
    (folder / "comparison.json").write_text(json.dumps(comparison))
    rendered = render_comparison(folder)
    assert not (folder / "plots" / "staleness.png").exists()
    assert len(rendered.plots) == 5


def test_a_run_of_one_epoch_still_has_a_curve(tmp_path):
    one_epoch = dataclasses.replace(DDP, accuracies=[0.8])
    rendered = render_comparison(write_comparison(tmp_path / "cmp", runs={"ddp": one_epoch}))
    run = json.loads(rendered.json_path.read_text())["runs"][0]
    assert len(run["series"]["test"]) == 1 and len(run["series"]["train"]) == STEPS_PER_EPOCH // 5
    assert run["speedup"] is None  # no baseline run


def test_a_run_of_one_logged_window_is_a_point_and_the_loss_plot_says_why():
    from disttrain.report.plots import loss_vs_step

    def row(name, steps):
        return {"name": name, "series": {"train": [{"step": s, "loss": 2.0 / s} for s in steps]}}

    colors = {"short": "C0", "long": "C1"}
    figure = loss_vs_step([row("short", [5]), row("long", range(5, 200, 5))], colors)
    (axes,) = figure.axes
    short, long = axes.get_lines()
    assert short.get_marker() == "o" and long.get_marker() in (None, "None", "")  # one point is visible
    (note,) = [text.get_text() for text in axes.texts]
    assert note.startswith("one logged window for short: ") and "training.log_interval" in note
    assert not loss_vs_step([row("long", range(5, 200, 5))], colors).axes[0].texts


@pytest.mark.parametrize("setup, fragment", [
    (lambda folder: None, "no such folder"),
    (lambda folder: folder.mkdir(), "has no comparison.json"),
    (lambda folder: (folder.mkdir(), (folder / "comparison.json").write_text("{")), "is not valid JSON"),
    (lambda folder: (folder.mkdir(), (folder / "comparison.json").write_text(
        '{"runs": [{"name": "a"}], "thresholds": [0.9], "perplexity_targets": [8]}')),
     "status should be one of"),
    (lambda folder: (folder.mkdir(), (folder / "comparison.json").write_text(
        '{"runs": [], "thresholds": [0.9]}')),
     "has no perplexity_targets .a comparison an earlier disttrain wrote.; run disttrain compare again"),
    (lambda folder: (folder.mkdir(), (folder / "comparison.json").write_text(
        '{"runs": [{"name": "a", "status": "ok", "log_dir": "a/logs"}], "thresholds": [0.9], '
        '"perplexity_targets": [8]}')), "summary.json: does not exist"),
])
def test_a_bad_comparison_folder_names_what_is_wrong(tmp_path, setup, fragment):
    folder = tmp_path / "cmp"
    setup(folder)
    with pytest.raises(InputFileError, match=fragment) as caught:
        render_comparison(folder)
    assert str(folder) in str(caught.value) and "\n" not in str(caught.value)
