"""The slow-link benchmark's Streaming DiLoCo configurations run end to end in its quick
mode (real PS and DDP runs across network namespaces on a 100 Mbit/s link, digits) and
record what their figures are made of: the largest exchange inside an epoch, a quarter of
an epoch's last step (every fragment's), and the share of the step blocked in exchanges."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STREAMING = ("ddp+local32+stream4", "ps-sync+local32+stream4")


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_the_streaming_configurations_record_a_fragment_per_exchange(tmp_path):
    output = tmp_path / "slow_link.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "slow_link.py"), "--quick",
                             "--rates", "100mbit", "--seed", "3", "--configs", ",".join(STREAMING),
                             "--output", str(output)],
                            capture_output=True, text=True, timeout=880, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    if "skipped" in figures:
        pytest.skip(figures["skipped"])
    assert figures["seed"] == 3 and set(figures["rates"]["100mbit"]) == set(STREAMING)
    for name, run in figures["rates"]["100mbit"].items():
        assert run["status"] == "ok", (name, run)
        exchange = run["exchange_bytes"]
        # Four fragments of about equal bytes: one per exchange inside an epoch, every one
        # at an epoch's last step.
        assert exchange["peak"] == pytest.approx(exchange["epoch_end"] / 4, rel=0.1), (name, exchange)
        assert 0.0 < run["comm_blocked_share"] < 1.0, (name, run)
        assert math.isfinite(run["final_loss"]) and 0.0 < run["final_accuracy"] <= 1.0
