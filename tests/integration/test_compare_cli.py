"""`disttrain compare` and `disttrain validate` from the command line: real runs of each
strategy as their own processes, one report over all of them, and bad input."""

import json
import subprocess
import sys

import pytest
import torch
from launched import Launched
from test_ps_cluster import cluster_processes, wait_until

FAST = ["--dataset", "digits", "--num-epochs", "1", "--num-threads", "1"]


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(60)
def test_an_unknown_strategy_is_refused_before_anything_runs(tmp_path, cli):
    result = cli("compare", *FAST, "--strategies", "baseline,ps-foo", "--output-dir", tmp_path / "c")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown strategy 'ps-foo'" in lines[0]
    assert not (tmp_path / "c").exists()


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs DDP over NCCL to fail (no CUDA device)")
@pytest.mark.slow  # a comparison of several runs: make test runs it, make test-fast does not
def test_a_failing_strategy_is_reported_as_failed_and_the_others_still_run(tmp_path, cli):
    folder = tmp_path / "c"
    result = cli("compare", *FAST, "--workers", "2", "--strategies", "ddp,baseline",
                 "--set", "ddp.backend=nccl", "--output-dir", folder)
    assert result.returncode == 1
    assert "1 of 2 runs failed (ddp)" in result.stderr
    manifest = json.loads((folder / "comparison.json").read_text())
    ddp, baseline = manifest["runs"]
    assert ddp["status"] == "failed" and "nccl" in ddp["error"].lower()
    assert baseline["status"] == "ok" and (folder / "baseline" / "logs" / "summary.json").is_file()
    report = json.loads((folder / "report.json").read_text())
    by_name = {run["name"]: run for run in report["runs"]}
    assert by_name["ddp"]["status"] == "failed" and by_name["ddp"]["error"] == ddp["error"]
    assert by_name["baseline"]["final_accuracy"] > 0.5
    assert "failed" in result.stdout and str(folder / "report.html") in result.stdout


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(60)
def test_a_folder_holding_a_comparison_is_not_overwritten(tmp_path, cli):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "comparison.json").write_text("{}")
    result = cli("compare", *FAST, "--strategies", "baseline", "--output-dir", folder)
    assert result.returncode == 2 and "already holds a comparison" in result.stderr
    assert (folder / "comparison.json").read_text() == "{}"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_killing_the_comparison_leaves_no_process_of_its_runs_behind(tmp_path):
    folder = tmp_path / "c"
    compare = Launched(
        [sys.executable, "-m", "disttrain", "compare", "--dataset", "digits", "--num-epochs", "500",
         "--workers", "2", "--strategies", "ps-sync,baseline", "--output-dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = [folder / "ps-sync" / "logs" / f"worker{r}" / "metrics.jsonl" for r in range(2)]
        wait_until(lambda: all(m.is_file() and m.stat().st_size for m in metrics), 90, "workers training")
        assert len(cluster_processes(tmp_path)) >= 5  # compare, ps launcher, coordinator, server, workers
        compare.kill()
        compare.wait(timeout=30)
        wait_until(lambda: cluster_processes(tmp_path) == [], 30, "every process of the runs to exit")
    finally:
        compare.kill()
        compare.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validate_checks_each_final_model_file_against_its_summary(tmp_path, cli):
    folder, output = tmp_path / "v", tmp_path / "properties.json"
    result = cli("validate", *FAST, "--workers", "2", "--epochs", "2", "--tolerance", "1",
                 "--output-dir", folder, "--output", output)
    assert result.returncode == 0, result.stderr[-2000:]
    properties = json.loads(output.read_text())["properties"]
    assert json.loads((folder / "validation.json").read_text())["properties"] == properties
    for run in ("baseline", "ps_sync", "ddp"):
        assert properties[f"{run}_finished"]["holds"]
        matches = properties[f"{run}_checkpoint_matches_summary"]
        assert matches["holds"] and matches["figures"]["evaluated_accuracy"] == pytest.approx(
            matches["figures"]["summary_accuracy"])
    assert properties["ps_sync_no_samples_lost"]["figures"]["samples_lost"] == 0
    assert properties["accuracies_agree"]["figures"]["baseline_batch_size"] == 2 * 64
    speedup = properties["ddp_speedup_over_baseline"]
    assert not speedup["applies"] and "--workers 4" in speedup["reason"] and speedup["figures"]["speedup"] > 0
    assert "n/a   ddp_speedup_over_baseline" in result.stdout
