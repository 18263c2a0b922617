"""`disttrain ddp` preempted: SIGTERM to one rank (`--inject term:rank=R:step=S`, through the
same handler a scheduler's signal meets) or to the launcher (the job's main process, which
forwards it to every rank) stops every rank at one step they agree on, with that step's
checkpoint; the launcher exits 143 with one line saying to resume, restarting nothing;
`--resume` then ends bit for bit where an uninterrupted run does, every sample trained
once. A rank that cannot stop within the grace period ends, and the launcher says that
no checkpoint was written for the stop and which one is the newest."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from launched import Launched
from live_runs import launcher_rank

from disttrain.core import checkpoint as ckpt

NUM_SAMPLES, BATCH_SIZE, NUM_EPOCHS = 2048, 32, 2
RUN = ["--world-size", 2, "--dataset", "synthetic", "--num-samples", NUM_SAMPLES, "--batch-size", BATCH_SIZE,
       "--num-epochs", NUM_EPOCHS, "--seed", 3, "--num-threads", 1]
TRAINING = [*RUN, "--checkpoint-interval", 1000]  # no periodic checkpoint: a stop writes its own
WAIT_S = 30  # for a process to reach a state the test waits for
STEPS = NUM_EPOCHS * NUM_SAMPLES // 2 // BATCH_SIZE
STOPPED = re.compile(r"^error: preempted at step (\d+): every rank stopped there with its checkpoint "
                     r"\((checkpoint_step\d+\.pt)\); run the same command with --resume to go on$")


def folders(path: Path) -> list:
    return ["--log-dir", path / "logs", "--checkpoint-dir", path / "ckpt"]


def final_model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("whole")
    result = run_cli("ddp", *TRAINING, *folders(path), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    return path


def stopped_step(stderr: str, path: Path) -> int:
    """The step the launcher's last line names; its checkpoint is the newest in `path`."""
    match = STOPPED.match(stderr.strip().splitlines()[-1])
    assert match, stderr[-3000:]
    step = int(match.group(1))
    assert ckpt.checkpoint_name(step) == match.group(2)
    assert max(ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(path / "ckpt")) == step
    return step


def resume_bit_identical(cli, path: Path, step: int, reference: Path) -> None:
    resumed = cli("ddp", *TRAINING, *folders(path), "--resume", timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, trained = final_model(reference), final_model(path)
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
    summary = json.loads((path / "logs" / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps"]) == (step, STEPS)
    assert summary["samples_processed"] == NUM_EPOCHS * NUM_SAMPLES  # each sample trained once an epoch


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_sigtermed_mid_epoch_stops_every_rank_at_one_step_and_resumes_bit_identical(
        cli, tmp_path, uninterrupted):
    cut = tmp_path / "cut"
    # Restarts allowed: the preempted group must not be restarted all the same.
    stopped = cli("ddp", *TRAINING, *folders(cut), "--max-restarts", 2, "--inject", "term:rank=1:step=5",
                  timeout=150)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "injected fault: SIGTERM at step 5" in stopped.stderr
    step = stopped_step(stopped.stderr, cut)
    assert 5 <= step < STEPS
    assert "restarting" not in stopped.stderr.lower()
    for rank in (0, 1):  # both ranks stopped there, neither was killed
        assert f"error: rank {rank}: stopped at step {step} with its checkpoint" in stopped.stderr
    resume_bit_identical(cli, cut, step, uninterrupted)


def start_launcher(*args) -> subprocess.Popen:
    return Launched([sys.executable, "-m", "disttrain", "ddp", *map(str, args)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})


def read_until(launcher: subprocess.Popen, pattern: str, seen: list[str]) -> None:
    """Read the launcher's output (kept in `seen`) up to a line matching `pattern`."""
    assert launcher.stderr is not None
    for line in launcher.stderr:
        seen.append(line)
        if re.search(pattern, line):
            return
    pytest.fail(f"the launcher ended without a line matching {pattern!r}:\n{''.join(seen)[-3000:]}")


def wait_for_pending(pid: int, signum: signal.Signals) -> None:
    """Wait until `signum` is pending on process `pid` (/proc's SigPnd and ShdPnd masks)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
        if pending >> (signum - 1) & 1:
            return
        time.sleep(0.01)
    pytest.fail(f"{signum.name} was not forwarded to the stopped rank {pid} within {WAIT_S}s")


def finish(launcher: subprocess.Popen, seen: list[str]) -> str:
    """The rest of the launcher's output, once it has exited (killed if the test failed first)."""
    try:
        _, rest = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return "".join(seen) + rest


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended  # the same stop and resume as a rank SIGTERMed, above
def test_the_launcher_sigtermed_stops_its_ranks_with_a_checkpoint_and_resumes_bit_identical(
        cli, tmp_path, uninterrupted):
    cut = tmp_path / "cut"
    launcher, seen = start_launcher(*TRAINING, *folders(cut)), []
    try:
        read_until(launcher, r"\[rank 0\] train \d+/", seen)  # the run has logged progress
        launcher.send_signal(signal.SIGTERM)  # as a scheduler stopping the job
    finally:
        stderr = finish(launcher, seen)
    assert launcher.returncode == 143, stderr[-3000:]
    step = stopped_step(stderr, cut)
    assert 0 < step < STEPS
    resume_bit_identical(cli, cut, step, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_sigterm_to_the_launcher_kills_the_ranks_at_once(tmp_path):
    # Rank 0 is stopped (SIGSTOP) for a minute, and the grace is ten: the ranks cannot stop
    # at a step in the test's time, so only the second signal can end them.
    launcher, seen = start_launcher(*RUN, "--checkpoint-interval", 2, *folders(tmp_path),
                                    "--preemption-grace", 600, "--inject", "stop:rank=0:step=3:for=60s"), []
    try:
        read_until(launcher, r"\[rank 0\] injected fault: stopped at step 3", seen)
        stopped = launcher_rank(launcher, lambda state, argv: state == "T", "a stopped rank")
        launcher.send_signal(signal.SIGTERM)
        # Forwarded to the ranks: pending on the stopped rank 0. (Rank 1 may be waiting for
        # rank 0 inside a collective, where its handler, on the main thread, cannot run.)
        wait_for_pending(stopped, signal.SIGTERM)
        launcher.send_signal(signal.SIGTERM)
    finally:
        stderr = finish(launcher, seen)
    assert launcher.returncode == 143, stderr[-3000:]
    newest = ckpt.latest_checkpoint(tmp_path / "ckpt")
    assert newest is not None and ckpt.checkpoint_step(newest) == 2
    assert stderr.strip().splitlines()[-1] == (
        "error: preempted: a second SIGTERM came before the ranks stopped, and they were killed; no "
        f"checkpoint was written for the stop; the newest checkpoint is {newest} (step 2): run the same "
        "command with --resume to go on from it")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_that_cannot_stop_within_the_grace_period_names_the_newest_checkpoint(cli, tmp_path):
    # Rank 0 is stopped (SIGSTOP) for longer than the grace period at the step rank 1 is
    # SIGTERMed at: rank 1 waits for it in the next all-reduce until its grace runs out.
    stopped = cli("ddp", *RUN, "--checkpoint-interval", 2, *folders(tmp_path), "--preemption-grace", 1,
                  "--inject", "term:rank=1:step=3", "--inject", "stop:rank=0:step=3:for=6s", timeout=150)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    newest = ckpt.latest_checkpoint(tmp_path / "ckpt")
    assert newest is not None and ckpt.checkpoint_step(newest) == 2
    assert stopped.stderr.strip().splitlines()[-1] == (
        "error: preempted: rank 1: the ranks did not stop with a checkpoint within 1s of the SIGTERM "
        "(system.preemption_grace_s); no checkpoint was written for the stop; the newest checkpoint is "
        f"{newest} (step 2): run the same command with --resume to go on from it")
