"""`--inject` and `--fault-plan` on real training processes: a kill lands exactly after its
step, a bad plan is a usage error naming its file and entry, and a stop really stops the
process and lets it go on afterwards."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launched import Launched

from disttrain.core import checkpoint as ckpt

RUN = ["baseline", "--dataset", "synthetic", "--num-samples", "256", "--batch-size", "16",
       "--num-epochs", "1", "--num-threads", "1"]


def dirs(tmp_path):
    return ["--checkpoint-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "logs"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_kill_from_a_plan_lands_right_after_its_step(tmp_path, cli):
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {action: kill, target: worker, index: 0, step: 3}\n")
    killed = cli(*RUN, *dirs(tmp_path), "--checkpoint-interval", "1", "--fault-plan", plan, timeout=50)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert ckpt.checkpoint_step(ckpt.latest_checkpoint(tmp_path / "ckpt")) == 3


@pytest.mark.slow  # a process of the command line each
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("command", "fault", "said"), [
    (["ddp", "--world-size", "2"], "kill:worker=1:step=2", "has no worker; its processes are rank=0..1"),
    (["ps", "--workers", "2"], "kill:server=3:step=2", "has 1 server(s), so server=3 does not exist"),
    ([], "kill:worker=0:step=17", "step 17 is past the run's end (a worker reaches step 16 at most)"),
    ([], "kill:worker=0:step=3:attempt=1", "attempt 1 never comes: the baseline run does not restart"),
    (["ps", "--workers", "2"], "stop:worker=1:step=3:for=1s:attempt=2",
     "no fault of the plan restarts that worker on its attempt 1"),
])
def test_a_fault_that_can_never_fire_is_refused_before_anything_starts(tmp_path, cli, command, fault, said):
    run = [command[0], *RUN[1:], *command[1:]] if command else RUN
    result = cli(*run, *dirs(tmp_path), "--inject", fault, timeout=50)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert fault in line and said in line, line
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(60)
def test_a_bad_plan_entry_is_a_usage_error_naming_file_and_entry(tmp_path, cli):
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - kill:worker=0:step=3\n  - {action: kill, target: wroker, step: 3}\n")
    result = cli(*RUN, *dirs(tmp_path), "--fault-plan", plan, timeout=50)
    assert result.returncode == 2
    assert str(plan) in result.stderr and "entry 2" in result.stderr and "'wroker'" in result.stderr
    assert not (tmp_path / "ckpt").exists()


def process_state(pid: int) -> str:
    """The one-letter state of process `pid` from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def read_until(stream, text: str) -> float:
    """Read lines until one holds `text`; the monotonic time it arrived."""
    for line in stream:
        if text in line:
            return time.monotonic()
    raise AssertionError(f"the process ended without logging {text!r}")


def wait_for_state(pid: int, wanted: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while process_state(pid) != wanted:
        assert time.monotonic() < deadline, f"process {pid} never reached state {wanted}"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_stop_really_stops_then_continues(tmp_path):
    stop_s = 1.0
    command = [sys.executable, "-m", "disttrain", *RUN, *map(str, dirs(tmp_path)),
               "--inject", f"stop:worker=0:step=2:for={stop_s * 1000:g}ms"]
    with Launched(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                  env={**os.environ, "PYTHONUNBUFFERED": "1"}) as process:
        try:
            stopping = read_until(process.stderr, "stopped at step 2")
            wait_for_state(process.pid, "T", timeout_s=5.0)
            continued = read_until(process.stderr, "continued after the stop at step 2")
            assert process_state(process.pid) != "T"
            assert stop_s <= continued - stopping < stop_s + 10.0
            process.stderr.read()
            assert process.wait(timeout=40) == 0
        finally:
            process.kill()
    assert (tmp_path / "ckpt" / "baseline_final.pt").exists()

