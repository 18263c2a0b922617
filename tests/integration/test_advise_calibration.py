"""The cost model's calibration as a test: real `disttrain ps` (sync, one shard) and
`disttrain ddp` runs of 2 processes (SimpleCNN, synthetic 28x28, batch 128, the quick
mode of `benchmarks/advise_accuracy.py`), each predicted from the compute its own
processes logged (`time/compute_s`) on this machine's loopback: the measured step must
fall within 25% of the prediction (the benchmark's `calibration_misses`, asserted on the
quick run's JSON). The compute comes from the run itself, so the machine's load moves both
sides; what is checked is the model's communication, waits and overheads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BATCH_SIZE = 128


@pytest.mark.bench
@pytest.mark.slow  # two training runs as subprocesses: one to three minutes on two busy cores
@pytest.mark.serial  # the runs' own speed decides what it checks
@pytest.mark.timeout(900)
def test_a_calibrated_runs_step_is_within_25_percent_of_the_prediction_from_its_own_compute(
        tmp_path, monkeypatch):
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    spec = importlib.util.spec_from_file_location("advise_accuracy_benchmark",
                                                  benchmarks / "advise_accuracy.py")
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    output = tmp_path / "advise_accuracy.json"
    command = [sys.executable, str(benchmarks / "advise_accuracy.py"), "--quick", "--processes", "2",
               "--processes-only", "--links", "none", "--repeats", "1", "--from-run-compute",
               "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=880, cwd=benchmarks)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    runs = figures["runs"]
    assert [(r["strategy"], r["num_processes"]) for r in runs] == [("ps_sync", 2), ("ddp", 2)]
    for run in runs:
        assert run["run_compute_s"] > 0 and run["measured_samples_per_s"] > 0
        # the step of 2 processes at batch 128 each, as the samples/s says
        measured_samples_per_s = run["measured_samples_per_s"]
        assert run["measured_step_s"] == pytest.approx(2 * BATCH_SIZE / measured_samples_per_s, rel=1e-3)
        assert run["predicted_step_s"] == pytest.approx(2 * BATCH_SIZE / run["predicted_from_run_compute"],
                                                        rel=1e-3)
        assert run["predicted_step_s"] > run["run_compute_s"]  # compute, and communication beyond it
        error = run["measured_step_s"] / run["predicted_step_s"] - 1
        assert abs(error) <= accuracy.TARGET, (
            f"{run['strategy']}: measured step {run['measured_step_s']} s against "
            f"{run['predicted_step_s']} s "
            f"predicted from the run's compute {run['run_compute_s']} s ({error:+.0%})")
    assert accuracy.calibration_misses(figures) == [] and figures["calibration_misses"] == []
    assert figures["all_within_target_from_run_compute"] is True
