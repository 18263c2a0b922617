"""The demo's comparison end to end: five strategies trained on digits as their own
processes, one report over them, its plots drawn from the runs' real streams, and the
HTML page opened in a real headless browser."""

import json
import re
import shutil

import pytest
from conftest import REPO_ROOT, run_cli
from matplotlib import image

from disttrain.metrics.hparams import read_hparams
from disttrain.metrics.logger import read_metrics

pytestmark = pytest.mark.slow

# The strategies `make demo` compares, read from the Makefile so the two never drift apart.
STRATEGIES = re.search(r"^DEMO_STRATEGIES := (\S+)$", (REPO_ROOT / "Makefile").read_text(),
                       re.MULTILINE).group(1).split(",")
PLOTS = ["accuracy_vs_time", "loss_vs_step", "throughput", "step_time", "bytes_per_step", "staleness",
         "advice_scaling"]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare") / "out"
    # Two thirds of digits' training samples: still three evaluations and a few train records
    # a process (8 steps an epoch for each of two workers, a record every 10), a third fewer steps.
    result = run_cli("compare", "--dataset", "digits", "--workers", "2", "--num-epochs", "3",
                     "--max-train-samples", "960", "--strategies", ",".join(STRATEGIES),
                     "--output-dir", folder, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result


@pytest.mark.timeout(420)
def test_the_table_names_every_strategy_and_the_report(comparison):
    folder, result = comparison
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.split()[:2][1:] == ["ok"]]
    assert rows == STRATEGIES
    assert f"Report: {folder / 'report.html'}" in result.stdout


@pytest.mark.timeout(420)
def test_the_report_carries_each_strategys_own_series_and_figures(comparison):
    folder, _ = comparison
    report = json.loads((folder / "report.json").read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == STRATEGIES and all(run["status"] == "ok" for run in runs.values())
    for name, run in runs.items():
        summary = json.loads((folder / name / "logs" / "summary.json").read_text())
        assert run["final_accuracy"] == summary["final_accuracy"]
        assert run["time_to_accuracy_s"] == summary["time_to_accuracy_s"]
        process = run["series"]["process"]
        records = read_metrics(folder / name / "logs" / process / "metrics.jsonl")
        tests = [r["accuracy/test"] for r in records if "accuracy/test" in r]
        assert [point["accuracy"] for point in run["series"]["test"]] == tests and len(tests) == 3
        assert len(run["series"]["train"]) == sum("loss/train" in r for r in records) > 1
        hparams, metrics = read_hparams(folder / name / "logs" / "hparams")
        assert hparams["strategy"] == summary["strategy"] and metrics["hparam/final_accuracy"] > 0
    assert runs["baseline"]["speedup"] == 1.0 and runs["baseline"]["bytes_per_step"] == 0
    assert runs["ddp"]["scaling_efficiency"] == pytest.approx(runs["ddp"]["speedup"] / 2)
    assert runs["ps-sync+topk"]["compression_ratio"] > 10 and runs["ps-sync"]["compression_ratio"] is None
    assert STRATEGIES == ["baseline", "ps-sync", "ps-async", "ddp", "ps-sync+topk"]
    assert set(runs["ps-async"]["staleness_histogram"]) != {"0"}  # async pushes do go stale
    assert set(runs["ps-sync"]["staleness_histogram"]) == {"0"}  # sync: always fresh
    assert sorted(report["ranking"]["samples_per_s"]) == sorted(STRATEGIES)


@pytest.mark.timeout(420)
def test_the_advice_section_predicts_each_strategy_from_the_runs_own_measurements(comparison):
    folder, _ = comparison
    report = json.loads((folder / "report.json").read_text())
    runs, advice = {run["name"]: run for run in report["runs"]}, report["advice"]
    workload = advice["inputs"]["workload"]
    # the baseline's own step, not a step timed again
    assert workload["compute_s"] == pytest.approx(runs["baseline"]["step_time"]["compute_s"])
    topk = workload["compression"]["topk"]
    assert topk["encode_s"] == pytest.approx(runs["ps-sync+topk"]["step_time"]["compression_s"])
    ratio = runs["ps-sync+topk"]["compression_ratio"]
    assert topk["payload_bytes"] == round(workload["gradient_bytes"] / ratio)
    assert advice["inputs"]["link"]["source"] == "loopback"
    curves = {curve["run"]: curve for curve in advice["curves"]}
    assert list(curves) == STRATEGIES[1:]
    assert curves["ps-sync+topk"]["configuration"] == "ps-sync S=1 +topk"
    for name, curve in curves.items():
        counts = [point["num_workers"] for point in curve["predicted"]]
        assert counts == [1, 2, 4, 8, 16, 32, 64]
        assert all(point["samples_per_s"] > 0 for point in curve["predicted"])
        measured = curve["measured"]
        assert measured["num_workers"] == 2 and measured["samples_per_s"] == runs[name]["samples_per_s"]
        assert measured["predicted_samples_per_s"] == curve["predicted"][1]["samples_per_s"]


@pytest.mark.timeout(420)
def test_every_plot_is_a_real_image(comparison):
    folder, _ = comparison
    for name in PLOTS:
        pixels = image.imread(folder / "plots" / f"{name}.png")
        assert pixels.shape[0] > 200 and pixels.shape[1] > 200
        assert pixels.std() > 0.01  # not a blank canvas


@pytest.mark.timeout(420)
def test_the_page_loads_every_plot_in_a_real_browser_without_the_network(comparison, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium installed (apt-get install chromium) to open report.html with")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright drives the browser")
    folder, _ = comparison
    requests: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("request", lambda request: requests.append(request.url))
            page.goto((folder / "report.html").as_uri(), wait_until="load")
            images = page.evaluate("[...document.images].map(i => [i.complete, i.naturalWidth])")
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert len(images) == len(PLOTS) and all(done and width > 0 for done, width in images)
    assert [url for url in requests if not url.startswith(("file:", "data:"))] == []
    shot = image.imread(tmp_path / "report.png")
    assert shot.shape[0] > 900 and shot.std() > 0.01
