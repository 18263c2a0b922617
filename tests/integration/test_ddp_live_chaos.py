"""The chaos benchmark's DDP part in quick mode, end to end: a rank killed mid-epoch under
live recovery and under torch's restart, each against its fault-free run; the JSON says
what each recovery cost and that live recovery lost nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_quick_ddp_chaos_compares_live_recovery_with_restart(tmp_path):
    output = tmp_path / "chaos.json"
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "chaos.py"), "--quick", "--strategies", "ddp",
               "--output", str(output), "--work-dir", str(tmp_path / "runs")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    ddp = json.loads(output.read_text())["ddp"]

    settings = ddp["settings"]
    assert 0 < settings["kill_step"] < settings["steps"] and settings["straggler"] != settings["killed_rank"]
    live, restart = ddp["live"]["killed"], ddp["restart"]["killed"]
    assert live["survivors_kept_their_process"] and live["num_rejoins"] >= 1
    assert (live["samples_lost"], live["samples_applied_twice"]) == (0, 0)
    assert live["samples_applied"] == ddp["live"]["fault_free"]["samples_applied"]
    assert 0 <= live["live_detect_s"] <= live["live_resume_s"] < 10.0 and live["live_rejoin_s"] > 0
    assert restart["restarts"] == 1 and restart["resumed_from_step"] <= settings["kill_step"]
    assert restart["steps_redone"] == settings["kill_step"] - restart["resumed_from_step"]
    for part in ("live", "restart"):
        assert abs(ddp[part]["accuracy_difference_points"]) <= 0.5
        assert ddp[part]["time_ratio"] > 0
