"""The chaos benchmark's quick mode end to end (digits, a few random faults): both runs
finish, faults are injected and noticed, no sample is lost, and the JSON says so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_full_run_keys

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(300)
def test_quick_chaos_run_loses_no_sample(tmp_path):
    output = tmp_path / "chaos.json"
    # Half the quick run's epochs and faults: the same paths, in half the time.
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "chaos.py"), "--quick", "--output", str(output),
               "--work-dir", str(tmp_path / "runs"), "--num-epochs", "2", "--max-faults", "2",
               "--strategies", "ps"]  # the DDP part has its own test (test_ddp_live_chaos.py)
    result = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    figures = json.loads(output.read_text())

    assert figures["quick"] and figures["dataset"] == "digits"
    assert figures["num_faults"] >= 1, figures["faults"]
    assert all(f["kind"] in figures["settings"]["kinds"] for f in figures["faults"])
    assert figures["chaos"]["num_failures"] >= 1  # the run noticed what was done to it
    assert figures["samples_lost"] == 0
    assert figures["chaos"]["samples_lost"] == 0
    for run in ("fault_free", "chaos"):
        assert 0.0 < figures[run]["final_accuracy"] <= 1.0
    assert figures["accuracy_difference_points"] == pytest.approx(
        100 * (figures["chaos"]["final_accuracy"] - figures["fault_free"]["final_accuracy"]), abs=0.01)
    assert figures["time_ratio"] > 0
    assert_full_run_keys(tmp_path)
