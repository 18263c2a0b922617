"""A synchronous parameter-server run preempted (SIGTERM), then resumed.

The launcher SIGTERMed as a scheduler would (once the run has logged progress): it
forwards the signal to every worker, which stop at one step they agree on, each with its
checkpoint of that step, then to the shards, which write theirs, and exits with 143 and a
line naming the step. One worker SIGTERMed alone (`term:worker=1:step=S`) stops the job
as a whole the same way: a preempted worker is a planned stop, never restarted. Either
way `--resume` ends bit for bit where an uninterrupted run does, every sample applied
once (from the shards' ledgers, through the summary).
"""

import json
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import run_cli
from launched import Launched

from disttrain.core import checkpoint as ckpt

TRAIN, BATCH, EPOCHS, WORKERS, SERVERS = 1280, 8, 2, 2, 2
STEPS = EPOCHS * TRAIN // WORKERS // BATCH  # per worker
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", str(WORKERS), "--servers", str(SERVERS),
        "--batch-size", str(BATCH), "--max-train-samples", str(TRAIN), "--max-test-samples", "200",
        "--num-epochs", str(EPOCHS), "--checkpoint-interval", "1000", "--num-threads", "1", "--seed", "3",
        # On a loaded machine a worker must not be declared failed by its heartbeats: a
        # failure and its restart would redo steps, and this test's runs have none.
        "--heartbeat-timeout", "60"]
PROCESSES = [f"worker{r}" for r in range(WORKERS)] + [f"server{s}" for s in range(SERVERS)]
LINE = re.compile(r"error: preempted by SIGTERM: checkpoints written at step (\d+) "
                  r"\(checkpoint_step\d+\.pt of every worker and shard\); run the same command with --resume "
                  r"to go on")


def folders(path):
    return ["--log-dir", path / "logs", "--checkpoint-dir", path / "ckpt"]


def final_model(path):
    return ckpt.load_checkpoint(path / "ckpt" / "parameter_server_final.pt")["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole")
    whole = run_cli("ps", *ARGS, *folders(path), timeout=200)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return final_model(path)


def logs(path, stderr: str = "") -> str:
    """What a failed assertion shows: the launcher's last lines and each process's."""
    parts = [f"--- launcher ---\n{stderr[-3000:]}"]
    for log in sorted((path / "logs").glob("*.log")):
        parts.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def stopped_step(path, stderr: str) -> int:
    """The step the launcher's last line names; every worker's and shard's newest checkpoint is of it."""
    match = LINE.fullmatch(stderr.strip().splitlines()[-1])
    assert match, logs(path, stderr)
    step = int(match.group(1))
    for name in PROCESSES:
        newest = ckpt.list_checkpoints(path / "ckpt" / name)[-1]
        assert ckpt.checkpoint_step(newest) == step, f"{name}\n{logs(path, stderr)}"
    for rank in range(WORKERS):  # the worker's only checkpoint: the preemption's (no periodic one)
        found = ckpt.list_checkpoints(path / "ckpt" / f"worker{rank}")
        assert [ckpt.checkpoint_step(p) for p in found] == [step]
    return step


def assert_resumed_as_uninterrupted(cli, path, step, expected):
    resumed = cli("ps", *ARGS, *folders(path), "--resume", timeout=200)
    assert resumed.returncode == 0, logs(path, resumed.stderr)
    trained = final_model(path)
    summary = json.loads((path / "logs" / "summary.json").read_text())
    same = expected.keys() == trained.keys() and all(torch.equal(expected[k], trained[k]) for k in expected)
    assert same, f"{summary}\n{logs(path, resumed.stderr)}"
    assert summary["resumed_from_step"] == step and summary["steps"] == STEPS, summary
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN, summary
    assert summary["samples_redone"] == 0, summary  # every worker and shard stopped at the same step
    assert summary["num_failures"] == 0, summary


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_preempted_launcher_stops_every_process_with_checkpoints_and_resumes_bit_identical(
        tmp_path, cli, uninterrupted):
    command = [sys.executable, "-m", "disttrain", "ps", *map(str, ARGS), *map(str, folders(tmp_path))]
    with Launched(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) as launcher:
        lines = []
        for line in launcher.stderr:  # the run's own progress line: the workers are training
            lines.append(line)
            if re.search(r"ps-sync \d+/\d+", line):
                launcher.send_signal(signal.SIGTERM)
                break
        rest = launcher.stderr.read()
        code = launcher.wait(timeout=120)
    stderr = "".join(lines) + rest
    assert code == 143, logs(tmp_path, stderr)
    step = stopped_step(tmp_path, stderr)
    assert 0 < step < STEPS
    assert "SIGTERM: stopping the workers at a step they agree on" in stderr
    assert_resumed_as_uninterrupted(cli, tmp_path, step, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_preempted_worker_stops_the_run_as_a_whole_never_restarted_and_it_resumes_bit_identical(
        tmp_path, cli, uninterrupted):
    stopped = cli("ps", *ARGS, *folders(tmp_path), "--inject", "term:worker=1:step=7", timeout=200)
    assert stopped.returncode == 143, logs(tmp_path, stopped.stderr)
    step = stopped_step(tmp_path, stopped.stderr)
    # the step worker 1 was in, or the next when worker 0 had passed its stop point already
    assert step in (7, 8)
    assert "worker1 was sent SIGTERM" in stopped.stderr
    log = (tmp_path / "logs" / "worker1.log").read_text()
    assert log.count("registered as rank 1") == 1  # a planned stop: not restarted
    assert_resumed_as_uninterrupted(cli, tmp_path, step, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.extended  # an async run preempted and resumed: test_ps_resize_async_cli
def test_a_preempted_async_run_stops_its_workers_at_one_step_and_resumes_with_every_sample_once(
        tmp_path, cli):
    # Asynchronous workers drift apart: the one behind goes on alone to the step agreed.
    # The shards' versions count every worker's pushes, so they are named apart.
    args = [*ARGS, "--aggregation-mode", "async"]
    stopped = cli("ps", *args, *folders(tmp_path), "--inject", "term:worker=1:step=7", timeout=200)
    assert stopped.returncode == 143, logs(tmp_path, stopped.stderr)
    steps = {ckpt.checkpoint_step(p) for r in range(WORKERS)
             for p in ckpt.list_checkpoints(tmp_path / "ckpt" / f"worker{r}")}
    assert len(steps) == 1 and min(steps) >= 7, logs(tmp_path, stopped.stderr)
    (step,) = steps
    assert f"the newest checkpoints are step {step} (worker0, worker1)" in stopped.stderr.splitlines()[-1]
    resumed = cli("ps", *args, *folders(tmp_path), "--resume", timeout=200)
    assert resumed.returncode == 0, logs(tmp_path, resumed.stderr)
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == step, summary
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN, summary
    assert summary["samples_redone"] == 0, summary
