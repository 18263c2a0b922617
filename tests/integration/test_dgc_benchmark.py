"""The compression benchmark's DGC mode runs end to end in its quick mode (real `disttrain
ps` runs, dense against top-k with DGC's rules, in async mode) and writes what its figures
are made of: the payload and wire ratios and the accuracy gap, each a real number."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_the_dgc_benchmark_writes_its_ratios_and_accuracy_gap(tmp_path):
    output = tmp_path / "compression_dgc.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "compression.py"), "--dgc", "--quick",
                             "--only", "ps-async,ps-async-dgc", "--output", str(output)],
                            capture_output=True, text=True, timeout=880, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    assert set(figures["runs"]) == {"ps-async", "ps-async-dgc"}
    dense, dgc = figures["runs"]["ps-async"], figures["runs"]["ps-async-dgc"]
    for run in (*dense["runs"], *dgc["runs"]):
        assert 0.0 < run["accuracy"] <= 1.0 and run["steps"] > 0
        assert run["wire_bytes_sent"] > 0 and run["wire_bytes_received"] > 0
    assert dense["runs"][0]["compression_ratio"] == 1.0  # dense: nothing compressed
    # The same steps in both runs, so the dense run's pushes bound the DGC run's from above.
    assert dgc["wire_bytes_sent"] < dense["wire_bytes_sent"]
    check = figures["checks"]["ps-async-dgc"]
    assert 0.0 < check["wire_share_of_dense"] < 0.2 and 0.0 < check["bytes_share_of_dense"] < 0.2
    assert check["fewer_bytes_x"] == pytest.approx(
        1 / max(check["wire_share_of_dense"], check["bytes_share_of_dense"]))
    drop = check["mean_accuracy_drop_points"]
    assert math.isfinite(drop) and drop == pytest.approx(100 * (dense["accuracy"] - dgc["accuracy"]))
    assert isinstance(check["met"], bool)
