"""The load benchmark's quick mode: 32 concurrent clients against one real server, in
async and sync mode, with nothing but the expected rejections and sync exact at the end."""

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
def test_thirty_two_clients_get_only_the_expected_rejections(tmp_path):
    output = tmp_path / "load.json"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "ps_load.py"), "--quick",
                             "--output", str(output)], capture_output=True, text=True, timeout=280,
                            cwd=REPO_ROOT / "benchmarks")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    phases = figures["phases"]
    assert [(p["mode"], p["attacker"]) for p in phases] == [
        ("async", False), ("async", True), ("sync", False), ("sync", True)]
    for phase in phases:
        assert phase["clients"] == 32 and phase["errors"] == {} and phase["clients_still_running"] == 0
        assert phase["pushes"] == 32 * phase["steps_per_client"]
        assert phase["expected_rejections"] == 4  # 4 of the 32 clients send one NaN push each
        assert phase["push_latency_p99_ms"] >= phase["push_latency_p50_ms"] > 0
        if phase["mode"] == "sync":
            assert phase["exact"]["holds"]
        if phase["attacker"]:  # its calls reached the server, and those over its slots were refused
            refused = sum(c["count"] for c in phase["attacker_calls_ended"]
                          if c["outcome"] == "RESOURCE_EXHAUSTED")
            assert refused > 0
    assert figures["passed"] and set(figures["p99_ratio_with_attacker"]) == {"async", "sync"}
    assert_full_run_keys(tmp_path)
