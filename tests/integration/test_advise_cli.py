"""`disttrain advise` from the command line: the table and --json for the shipped models and
a user's file, the simulation, the link probe between `--serve` and `--peer` over a real
socket (with the run's token), and one-line errors with exit 2 for bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_full_run_keys
from plugin_files import write_plugin

from disttrain.cli import main

pytestmark = pytest.mark.timeout(180)
QUICK = ["--step-time", "0.1", "--batch-size", "2"]


def advise_json(*args: str) -> dict:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["advise", "--json", *args]) == 0
    return json.loads(out.getvalue())


@pytest.mark.slow  # a process that measures the model and simulates 8 workers in every mode
def test_table_and_simulation_from_the_command_line(cli):
    result = cli("advise", "--model", "simplecnn", "--dataset", "digits", "--batch-size", "8", "--link",
                 "1gbit,0.2ms", "--workers", "1,8,64", "--simulate", "8", "--stragglers", "0.125",
                 "--sim-steps", "20", "--num-threads", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "link: 1 Gbit/s, 200 us (given)" in out and "cheapest within 10%" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in ("1", "8", "64")]
    assert [row[0] for row in rows] == ["1", "8", "64"]
    for mode in ("sync ", "sync b=1", "ssp tau=2", "async"):
        assert any(line.startswith(mode) for line in out.splitlines()), mode


@pytest.mark.slow  # two measurements of the model, each simulated in every mode
def test_a_share_of_the_data_each_makes_the_straggler_end_every_mode():
    """--sim-share: each of 4 workers has 20 steps of data; one is 3x slower, so every mode
    takes at least its 20 slow steps, and every step of every worker is computed once.
    A small CNN at 16 samples: its optimizer step is a small part of its compute (a few %,
    against 100% and more for the MLP at 2, whose every timing is noise-sized)."""
    workload = ["--model", "simplecnn", "--dataset", "digits", "--step-time", "0.1", "--batch-size", "16",
                "--link", "10gbit,50us", "--workers", "4", "--simulate", "4", "--stragglers", "0.25",
                "--sim-steps", "20", "--num-threads", "1"]
    report = advise_json(*workload, "--sim-share")
    runs = report["simulations"]
    assert [r["mode"] for r in runs] == ["sync", "sync", "ssp", "async", "local"]
    # the shard's optimizer step, timed here and scaled as the compute was, adds up to one per
    # push on the straggler's path (it varies from run to run)
    slow_step = 3 * 0.1 + report["workload"]["optimizer_s"]
    for run in runs[:4]:
        assert run["num_pushes"] == 4 * 20
        assert 20 * 3 * 0.1 <= run["virtual_time_s"] < 20 * slow_step * 1.2
    # local updates (every 8 steps by default): each exchange waits for the straggler too
    assert runs[4]["sync_every"] == 8 and runs[4]["virtual_time_s"] >= 20 * 3 * 0.1
    steady = advise_json(*workload)
    # async without shares: the fast workers carry the run, the straggler no longer ends it;
    # against the straggler's 20 steps as this second measurement times them
    straggler_s = 20 * (3 * 0.1 + steady["workload"]["optimizer_s"])
    assert steady["simulations"][3]["virtual_time_s"] < 0.75 * straggler_s


@pytest.mark.slow  # builds and measures 11 M parameters: 20-30 s on two busy cores
@pytest.mark.parametrize("model, dataset, extra", [
    ("resnet18", "synthetic:3x32x32", []),
    pytest.param("gpt_small", "synthetic:text", ["--seq-len", "16"], marks=pytest.mark.extended),
])
def test_answers_for_the_shipped_workloads(model, dataset, extra):
    report = advise_json("--model", model, "--dataset", dataset, *extra, *QUICK, "--link", "10gbit,50us",
                         "--workers", "1,64,1024")
    assert report["workload"]["model"] == model and report["workload"]["num_parameters"] > 10**6
    assert report["workload"]["compute_s"] == pytest.approx(0.1)
    sizes = [entry["num_workers"] for entry in report["advice"]]
    assert sizes == [1, 64, 1024]
    for entry in report["advice"]:
        fastest, cheapest = entry["fastest"], entry["cheapest_within_10pct"]
        assert cheapest["samples_per_s"] >= 0.9 * fastest["samples_per_s"]
        assert fastest["efficiency"] > 0
    alone = report["advice"][0]["best_by_strategy"]["ddp"]
    assert alone["efficiency"] == pytest.approx(1.0) and alone["bytes_per_step"] == 0


@pytest.mark.slow  # measures the user's model and every compressor on it
def test_answers_for_a_users_model_file(tmp_path):
    plugin = write_plugin(tmp_path)
    report = advise_json("--model", f"{plugin}:model", "--dataset", f"{plugin}:data", *QUICK,
                         "--link", "100mbit,1ms", "--workers", "4")
    assert report["workload"]["num_parameters"] == 8 * 16 + 16 + 16 * 2 + 2
    assert report["advice"][0]["num_workers"] == 4


def free_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a process of the command line each, seconds on busy cores
@pytest.mark.parametrize("args, says", [
    (["--link", "1gigabit,2ms"], "--link '1gigabit,2ms': write BANDWIDTH,LATENCY, e.g. 1gbit,0.2ms"),
    (["--model", "no_such_model"], "'no_such_model' is not a registered model"),
    (["--model", "missing_file.py:build"], "missing_file.py does not exist"),
    (["--peer", f"127.0.0.1:{free_closed_port()}"], "cannot connect"),
    (["--max-servers", "0"], "--max-servers 0: must be >= 1"),
    (["--link", "1gbit,1ms", "--simulate", "4", "--stragglers", "2"], "straggler fraction 2.0 must be in"),
])
def test_bad_input_is_one_line_and_exit_2(cli, args, says):
    result = cli("advise", "--dataset", "digits", "--step-time", "0.1", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr


@pytest.mark.slow  # a serving process, and a measurement of the model through it
def test_serve_and_peer_measure_the_link_with_the_token(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("advise-test-token\n")
    token.chmod(0o600)
    command = [sys.executable, "-m", "disttrain", "advise", "--serve", "--bind", "127.0.0.1:0",
               "--token-file", str(token)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = server.stdout.readline()
        assert line.startswith("serving link probes on 127.0.0.1:"), line + server.stderr.read()
        address = line.split()[-1]
        report = advise_json("--peer", address, "--token-file", str(token), "--model", "mlp", "--dataset",
                             "digits", *QUICK, "--workers", "1,2")
        link = report["link"]
        assert link["source"] == f"peer {address}"
        assert link["bandwidth_bytes_per_s"] > 1e6 and 0 < link["latency_s"] < 0.1
        monkeypatch.setenv("DISTTRAIN_TOKEN", "not-the-token")
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["advise", "--peer", address, "--model", "mlp", "--dataset", "digits", *QUICK]) == 2
        assert "refused: missing or wrong token" in err.getvalue()
        assert len(err.getvalue().strip().splitlines()) == 1
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow  # two training runs as subprocesses: about a minute on two busy cores
@pytest.mark.bench
@pytest.mark.timeout(600)
def test_the_calibration_benchmark_runs_in_quick_mode(tmp_path):
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    output = tmp_path / "advise_accuracy.json"
    command = [sys.executable, str(benchmarks / "advise_accuracy.py"), "--quick", "--processes", "1",
               "--processes-only", "--links", "none", "--repeats", "1", "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=580, cwd=benchmarks)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    assert [(r["strategy"], r["num_processes"]) for r in figures["runs"]] == [("ps_sync", 1), ("ddp", 1)]
    for run in figures["runs"]:
        assert run["predicted_samples_per_s"] > 0 and run["measured_samples_per_s"] > 0
        ratio = run["predicted_samples_per_s"] / run["measured_samples_per_s"]
        assert run["error"] == pytest.approx(ratio - 1, abs=0.01)
        assert run["run_compute_s"] > 0 and run["predicted_from_run_compute"] > 0
        given = run["predicted_from_run_compute"] / run["measured_samples_per_s"]
        assert run["error_from_run_compute"] == pytest.approx(given - 1, abs=0.01)
    # the limited links take root and minutes: left out here, their keys still written
    assert figures["limited_links"] == {"rates": [], "runs": [], "skipped": "--links none"}
    assert_full_run_keys(tmp_path)
