"""The GPU check (tools/gpu_check.sh): without CUDA one line and exit 0; a step that hangs
is stopped at its timeout with what it wrote kept, and the next step still runs; a step
with no time left is recorded as not run; and (make test-bench) the whole check's dry
run on the CPU passes every step."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "gpu_check.sh"

pytestmark = pytest.mark.timeout(120)

# A step script for the runner: writes its result file, then ends or never does.
FAKE_STEPS = """
import json, sys, threading
name, result = sys.argv[1], sys.argv[sys.argv.index("--result") + 1]
with open(result, "w") as f:
    json.dump({"summary": name + " wrote this", "written_by": name}, f)
if name == "hangs":
    threading.Event().wait()
"""


def gpu_check():
    """tools/gpu_check.py, loaded from its file (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the script and its Python as processes
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=100)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"gpu_check: no CUDA device here \(torch \S+ sees none\); nothing to check "
                        r"\(--cpu runs the steps on the CPU\)\n", done.stdout), done.stdout
    assert done.stderr == "" and list(tmp_path.iterdir()) == []


def fake_run(monkeypatch, tmp_path, steps, *args):
    """gpu_check's main with `steps` (name, timeout) run by FAKE_STEPS, on the CPU."""
    module = gpu_check()
    script = tmp_path / "steps.py"
    script.write_text(FAKE_STEPS)
    steps = tuple(module.Step(name, timeout, timeout, name) for name, timeout in steps)
    monkeypatch.setattr(module, "STEPS", steps)
    monkeypatch.setattr(module, "STEPS_SCRIPT", script)
    monkeypatch.setattr(module, "probe", lambda python, env: {"cuda_available": False})
    output = tmp_path / "out" / "gpu_check.json"
    code = module.main(["--cpu", "--output", str(output), "--work", str(tmp_path / "work"), *args])
    return code, json.loads(output.read_text())


@pytest.mark.slow  # step processes, one waited on for its 5 s timeout
def test_a_step_that_hangs_is_stopped_at_its_timeout_and_the_next_step_runs(monkeypatch, tmp_path):
    code, report = fake_run(monkeypatch, tmp_path, [("hangs", 5), ("ends", 30)])
    hangs, ends = report["steps"]["hangs"], report["steps"]["ends"]
    assert code == 1 and not report["passed"]
    assert hangs["status"] == "timed_out" and hangs["duration_s"] < 5 + 5 + 10  # timeout, grace, slack
    assert hangs["figures"] == {"written_by": "hangs"} and hangs["summary"] == "hangs wrote this"
    assert ends["status"] == "passed" and ends["figures"] == {"written_by": "ends"}
    assert report["mode"] == "cpu" and report["steps"]["install"]["status"] == "skipped"


def test_a_step_without_time_left_is_recorded_as_not_run(monkeypatch, tmp_path):
    code, report = fake_run(monkeypatch, tmp_path, [("ends", 30)], "--budget-s", "5")
    assert code == 1 and report["steps"]["ends"]["status"] == "not_run"
    assert "budget" in report["steps"]["ends"]["summary"]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(1000)
def test_the_dry_run_on_the_cpu_passes_every_step(tmp_path):
    output = tmp_path / "gpu_check.json"
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", "--output", str(output),
                           "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
                          timeout=960)  # its budget under --cpu is 900 s
    report = json.loads(output.read_text())
    statuses = {name: step["status"] for name, step in report["steps"].items()}
    assert done.returncode == 0 and report["passed"], (statuses, done.stdout[-3000:])
    assert statuses == {"install": "skipped", "environment": "passed", "gpu_tests": "passed",
                        "ddp_backends": "passed", "precision": "passed", "ps_wire": "passed",
                        "workloads": "passed"}
    figures = report["steps"]["workloads"]["figures"]["results"]
    assert {s["status"] for model in figures.values() for s in model["strategies"].values()} == {"passed"}
