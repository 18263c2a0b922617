"""Every quick benchmark of `make bench` runs to its JSON, with the keys of the full run's
(benchmarks/shapes.json): a benchmark broken by a change to the code it drives fails here,
not at the next measurement. (The load and chaos benchmarks have their own tests, which
check the keys too; compression and slow_link take minutes; they are left out.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_full_run_keys

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["codec", "ps_roundtrip", "ps_vs_allreduce", "ps_training", "grpc_overhead",
                                  "heterogeneous", "baseline_overhead", "ddp_scaling"])
def test_the_benchmark_runs_in_quick_mode(tmp_path, name):
    output = tmp_path / f"{name}.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--repeats", "1",
                             "--output", str(output)], capture_output=True, text=True, timeout=280,
                            cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(output.read_text())
    assert figures["benchmark"] == name and figures["environment"]["torch"]
    assert_full_run_keys(tmp_path)
