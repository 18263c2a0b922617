"""`disttrain report` from the command line: a comparison folder rendered again, the
performance report from the artifacts of real runs (`--artifacts-dir`), and bad input
(one line naming the file, exit code 2)."""

import json

import pytest
from run_folders import PS_SYNC, RUNS, write_comparison, write_run

from disttrain.report.artifacts import write_run_artifacts

# One epoch: 12 steps a worker, a window record at step 10, which the report's figures read.
FAST = ["--dataset", "digits", "--num-epochs", "1", "--num-threads", "1"]


def dirs(tmp_path, name):
    return ["--log-dir", tmp_path / name / "logs", "--checkpoint-dir", tmp_path / name / "ckpt",
            "--artifacts-dir", tmp_path / "artifacts"]


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(120)
def test_report_renders_a_comparison_folder(tmp_path, cli):
    folder = write_comparison(tmp_path / "cmp", failed={"ps-async": "exit code 1: killed"})
    result = cli("report", folder)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert {line.split()[0] for line in lines[1:len(RUNS) + 2]} == {*RUNS, "ps-async"}
    assert "failed: exit code 1: killed" in result.stdout
    assert lines[-1] == f"report: {folder / 'report.html'}"
    report = json.loads((folder / "report.json").read_text())
    assert [run["name"] for run in report["runs"]] == [*RUNS, "ps-async"]
    assert (folder / "report.html").stat().st_size > 10_000 and (folder / "report.md").exists()


@pytest.mark.slow  # two processes of the command line
@pytest.mark.timeout(120)
def test_report_predicts_scaling_on_the_link_given_and_refuses_a_bad_one(tmp_path, cli):
    folder = write_comparison(tmp_path / "cmp")
    bad = cli("report", folder, "--advise-link", "fast")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "--advise-link 'fast'" in lines[0] and "1gbit,0.2ms" in lines[0]
    assert not (folder / "report.json").exists()
    result = cli("report", folder, "--advise-link", "10gbit,50us")
    assert result.returncode == 0, result.stderr
    advice = json.loads((folder / "report.json").read_text())["advice"]
    link = advice["inputs"]["link"]
    assert link == {"bandwidth_bytes_per_s": 1.25e9, "latency_s": pytest.approx(50e-6), "source": "given"}
    assert [curve["run"] for curve in advice["curves"]] == [name for name in RUNS if name != "baseline"]
    assert (folder / advice["plot"]).stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_artifacts_of_real_runs_make_one_perf_report(tmp_path, cli):
    baseline = cli("baseline", *FAST, *dirs(tmp_path, "baseline"))
    assert baseline.returncode == 0, baseline.stderr
    assert f"Artifacts: baseline.json in {tmp_path / 'artifacts'}" in baseline.stdout
    ps = cli("ps", "--workers", "2", *FAST, *dirs(tmp_path, "ps"))
    assert ps.returncode == 0, ps.stderr
    assert "Artifacts: ps.json, worker_metrics.json" in ps.stdout

    artifacts = tmp_path / "artifacts"
    summaries = {name: json.loads((tmp_path / name / "logs" / "summary.json").read_text())
                 for name in ("baseline", "ps")}
    assert json.loads((artifacts / "baseline.json").read_text())["final_accuracy"] == \
        summaries["baseline"]["final_accuracy"]
    workers = json.loads((artifacts / "worker_metrics.json").read_text())["workers"]
    assert [w["process"] for w in workers] == ["worker0", "worker1"]
    assert sum(w["samples"] for w in workers) == summaries["ps"]["samples_processed"]

    output = tmp_path / "reports" / "perf_report.json"
    result = cli("report", "--output", output, "--baseline-json", artifacts / "baseline.json",
                 "--ps-json", artifacts / "ps.json",
                 "--worker-metrics-json", artifacts / "worker_metrics.json")
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    entries = {entry["kind"]: entry for entry in report["strategies"]}
    base_rate = summaries["baseline"]["throughput_samples_per_s"]
    assert entries["ps"]["samples_per_s"] == summaries["ps"]["throughput_samples_per_s"]
    assert entries["ps"]["speedup"] == pytest.approx(entries["ps"]["samples_per_s"] / base_rate)
    assert entries["ps"]["scaling_efficiency"] == pytest.approx(entries["ps"]["speedup"] / 2)
    assert entries["ps"]["final_accuracy"] == summaries["ps"]["final_accuracy"]
    group = report["processes"]["ps"]
    assert [p["process"] for p in group["processes"]] == ["worker0", "worker1"]
    assert {group["spread"]["slowest"], group["spread"]["fastest"]} <= {"worker0", "worker1"}
    assert all(p["wire_bytes_per_step"] > 0 and 0 < p["comm_share"] < 1 for p in group["processes"])
    assert "ps-sync" in result.stdout and "worker1" in result.stdout


def one_line_error(result, path):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], result.stderr
    return lines[0]


def ps_artifact(tmp_path):
    """A ps.json as `disttrain ps --artifacts-dir` writes it, from a written run folder."""
    summary = write_run(tmp_path / "run", PS_SYNC)
    return write_run_artifacts(summary.to_dict(), tmp_path / "artifacts")[0]


@pytest.mark.slow  # a process of the command line each
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing", "not json", "wrong shape", "wrong kind", "no comparison"])
def test_bad_input_exits_2_with_one_line_naming_the_file(tmp_path, cli, case):
    path = tmp_path / "input.json"
    args = ["--ps-json", path]
    if case == "not json":
        path.write_text('{"kind": "ps", ')
    elif case == "wrong shape":
        path.write_text('{"kind": "ps", "strategy": "ps-sync"}')
    elif case == "wrong kind":
        path = ps_artifact(tmp_path)
        args = ["--ddp-rank-json", path]
    elif case == "no comparison":
        path = tmp_path
        args = [path]
    line = one_line_error(cli("report", *args), path)
    expected = {"missing": "does not exist", "not json": "is not valid JSON", "wrong shape": 'has no "',
                "wrong kind": "is a 'ps' artifact (ps.json), but --ddp-rank-json takes a 'ddp_rank'",
                "no comparison": "has no comparison.json"}[case]
    assert expected in line
