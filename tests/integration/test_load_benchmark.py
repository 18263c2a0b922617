"""The load benchmark's quick mode: 32 concurrent clients, each with its own node token,
against one real server and coordinator, in async and sync mode, alone, beside an
outsider and beside an insider holding one worker's valid token: nothing but the
expected rejections for the honest clients, sync exact at the end, and the attackers'
calls refused (the outsider's for its credentials, the insider's past its own share)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_full_run_keys

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(420)
def test_thirty_two_clients_get_only_the_expected_rejections(tmp_path):
    output = tmp_path / "load.json"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "ps_load.py"), "--quick",
                             "--output", str(output)], capture_output=True, text=True, timeout=400,
                            cwd=REPO_ROOT / "benchmarks")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    phases = figures["phases"]
    assert [(p["mode"], p["attacker"]) for p in phases] == [
        (mode, attacker) for mode in ("async", "sync") for attacker in (None, "outsider", "insider")]
    for phase in phases:
        assert phase["clients"] == 32 and phase["errors"] == {} and phase["clients_still_running"] == 0
        assert phase["pushes"] == phase["heartbeats"] == 32 * phase["steps_per_client"]
        assert phase["expected_rejections"] == 4  # 4 of the 32 clients send one NaN push each
        assert phase["push_latency_p99_ms"] >= phase["push_latency_p50_ms"] > 0
        if phase["mode"] == "sync":
            assert phase["exact"]["holds"]
        ended = {(c["call"], c["outcome"]): c["count"] for c in phase["attacker_calls_ended"] or ()}
        if phase["attacker"] == "outsider":  # no credentials: refused before anything is read
            assert {outcome for _, outcome in ended} == {"UNAUTHENTICATED"}
        if phase["attacker"] == "insider":  # past its own share, every kind of call is refused
            refused = {call for call, outcome in ended if outcome in ("RESOURCE_EXHAUSTED", "ALREADY_EXISTS")}
            assert refused == {call for call, _ in ended}
    assert figures["passed"]
    assert set(figures["p99_ratio_with_attacker"]) == {f"{mode} {attacker}" for mode in ("async", "sync")
                                                      for attacker in ("outsider", "insider")}
    assert_full_run_keys(tmp_path)
