"""The advice section of a comparison's report: each run's configuration predicted by the
cost model from the comparison's own baseline step, drawn and written beside what each
run measured (run folders written by the real logger, as `disttrain compare` leaves them)."""

import json

import pytest
from matplotlib import image
from run_folders import BASELINE, RUNS, write_comparison

from disttrain.advise import Candidate, CostModel, Workload, parse_link
from disttrain.advise.comparison import comparison_advisor
from disttrain.config import config_from_dict
from disttrain.report import render_comparison
from disttrain.training import init_model

LINK = "1gbit,0.2ms"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    folder = write_comparison(tmp_path_factory.mktemp("advice") / "cmp")
    render_comparison(folder, comparison_advisor(parse_link(LINK)))
    return folder, json.loads((folder / "report.json").read_text())


@pytest.mark.timeout(120)
def test_the_predictions_start_from_the_baselines_measured_step(rendered):
    folder, report = rendered
    advice = report["advice"]
    workload = advice["inputs"]["workload"]
    assert workload["compute_s"] == pytest.approx(BASELINE.step_s)  # the baseline's, not timed anew
    params = list(init_model(config_from_dict({"training": {"dataset": "digits"}}).training).parameters())
    numel = sum(p.numel() for p in params)
    expected = Workload(workload["model"], numel, 4 * numel, len(params), workload["batch_size"],
                        BASELINE.step_s / 3, 2 * BASELINE.step_s / 3, 0.0)
    model = CostModel(expected, parse_link(LINK))
    curves = {curve["run"]: curve for curve in advice["curves"]}
    assert list(curves) == [name for name in RUNS if name != "baseline"]
    ps = curves["ps-sync"]
    assert ps["configuration"] == "ps-sync S=1"
    for point in ps["predicted"]:
        prediction = model.predict(Candidate("ps-sync", "none", 1), point["num_workers"])
        assert point["samples_per_s"] == pytest.approx(prediction.samples_per_s)
        single = expected.batch_size / BASELINE.step_s
        assert point["speedup"] == pytest.approx(prediction.samples_per_s / single)
    assert [p["num_workers"] for p in ps["predicted"]] == [1, 2, 4, 8, 16, 32, 64]
    assert curves["ddp"]["predicted"][0]["speedup"] == pytest.approx(1.0)


@pytest.mark.timeout(120)
def test_each_run_measured_point_sits_beside_its_prediction(rendered):
    folder, report = rendered
    rows = {row["name"]: row for row in report["runs"]}
    for curve in report["advice"]["curves"]:
        measured, row = curve["measured"], rows[curve["run"]]
        assert measured["num_workers"] == row["workers"] == 2
        assert measured["samples_per_s"] == row["samples_per_s"] and measured["speedup"] == row["speedup"]
        at = next(p for p in curve["predicted"] if p["num_workers"] == 2)
        assert measured["predicted_samples_per_s"] == at["samples_per_s"]
        ratio = at["samples_per_s"] / row["samples_per_s"]
        assert measured["predicted_over_measured"] == pytest.approx(ratio)
    assert report["advice"]["plot"] in report["plots"]
    pixels = image.imread(folder / report["advice"]["plot"])
    assert pixels.shape[0] > 200 and pixels.std() > 0.01
    page = (folder / "report.md").read_text()
    assert "## Predicted scaling (disttrain advise)" in page and "ps-sync (ps-sync S=1) at 2 workers" in page
    assert "Predicted scaling" in (folder / "report.html").read_text()


@pytest.mark.slow  # renders a comparison's report twice, plots too: seconds
@pytest.mark.timeout(120)
def test_without_a_baseline_there_is_no_prediction_and_no_plot(tmp_path):
    folder = write_comparison(tmp_path / "cmp", {k: v for k, v in RUNS.items() if k != "baseline"})
    render_comparison(folder, comparison_advisor(parse_link(LINK)))
    report = json.loads((folder / "report.json").read_text())
    assert report["advice"]["curves"] == [] and "no finished baseline" in report["advice"]["unavailable"]
    assert not (folder / "plots" / "advice_scaling.png").exists()
    render_comparison(folder)
    assert json.loads((folder / "report.json").read_text())["advice"] is None
