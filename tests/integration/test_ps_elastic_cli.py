"""`disttrain ps --workers 2:3`: a parameter-server run that grows and shrinks while it
trains, through checkpoints rewritten for each size, without anyone resuming it. The run
starts on 2 workers; SIGUSR1 to the launcher (sent once the run's progress line shows it
training) grows it to 3; SIGTERM to worker 2 of those (`--inject term:worker=2:step=S`, a
planned leave) shrinks it back to 2, mid-epoch 1; the run ends normally (exit 0). Every
sample of each epoch is applied exactly once across both changes (the shards' ledgers,
through the summary) and trained once (what the model's forward was given in every worker
process of the three launches); the global batch of 12 is kept at each size, as the
launcher's log says. A SIGTERM that would take the run below MIN stops it with exit 143."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launched import Launched
from test_ps_resize_cli import (
    BATCH_SIZE,
    NUM_EPOCHS,
    NUM_SAMPLES,
    PLUGIN,
    assert_each_sample_once_an_epoch,
    config_file,
    epochs_trained,
)

# The worker processes of a launch after a change of size are started with --resume: their
# records say so, and their batch (4 on 3 workers, 6 on 2) tells the two such launches apart.
ELASTIC_PLUGIN = PLUGIN.replace("f\"{os.environ['RUN_LABEL']}-{os.getpid()}\"",
                                "f\"{os.environ['RUN_LABEL']}{'-resumed' if '--resume' in sys.argv else ''}"
                                "-{os.getpid()}\"")
LEAVE_STEP = 70  # worker 2 leaves at its first step from 70 on: in epoch 1 (50 steps an epoch)
REWROTE = re.compile(r"rewrote the checkpoints of (\d+) workers \(epoch (\d+), ")


def elastic(path: Path, *args: str) -> tuple[int, str]:
    """Run `disttrain ps --workers 2:3 ARGS`, sending SIGUSR1 to its launcher at its first
    progress line; its exit code and stderr."""
    config_file(path)
    assert ELASTIC_PLUGIN != PLUGIN
    (path / "indexed.py").write_text(ELASTIC_PLUGIN)
    (path / "records").mkdir()
    command = [sys.executable, "-m", "disttrain", "ps", "--config", str(path / "run.yaml"),
               "--workers", "2:3", "--servers", "2", "--num-threads", "1", "--heartbeat-timeout", "60",
               "--log-dir", str(path / "logs"), "--checkpoint-dir", str(path / "ckpt"), *args]
    env = {"PYTHONUNBUFFERED": "1", "RESIZE_RECORDS": str(path / "records"), "RUN_LABEL": "elastic"}
    with Launched(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                  env={**os.environ, **env}) as launcher:
        lines = []
        for line in launcher.stderr:  # the run's own progress line: the workers are training
            lines.append(line)
            if re.search(r"ps-sync \d+/\d+", line):
                launcher.send_signal(signal.SIGUSR1)
                break
        rest = launcher.stderr.read()
        code = launcher.wait(timeout=300)
    return code, "".join(lines) + rest


def logs(path: Path, stderr: str) -> str:
    parts = [f"--- launcher ---\n{stderr[-4000:]}"]
    for log in sorted((path / "logs").glob("*.log")):
        parts.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-12:]))
    return "\n".join(parts)


def per_launch_records(path: Path, stderr: str) -> list[tuple[str, int]]:
    """The records of the three launches, each as its own label, with the epoch it started in."""
    starts = [(int(written), int(epoch)) for written, epoch in REWROTE.findall(stderr)]
    assert [written for written, _ in starts] == [2, 3], starts  # grown from 2, shrunk from 3
    records = path / "records"
    for file in records.glob("elastic-resumed-*"):
        first = file.read_text().splitlines()[0].split()
        label = "grown" if len(first) == BATCH_SIZE * 2 // 3 else "shrunk"
        shutil.move(file, records / f"{label}-{file.name.rsplit('-', 1)[1]}")
    return [("elastic", 0), ("grown", starts[0][1]), ("shrunk", starts[1][1])]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_of_two_to_three_grows_and_shrinks_back_mid_epoch_applying_every_sample_once(tmp_path):
    code, stderr = elastic(tmp_path, "--inject", f"term:worker=2:step={LEAVE_STEP}")
    assert code == 0, logs(tmp_path, stderr)
    assert "SIGUSR1: growing from 2 to 3 workers" in stderr, logs(tmp_path, stderr)
    assert "worker2 was sent SIGTERM: a planned leave, 3 to 2 workers" in stderr, logs(tmp_path, stderr)
    for written, workers in ((2, 3), (3, 2)):
        per_worker = BATCH_SIZE * 2 // workers
        said = (f"resuming a checkpoint of {written} workers on {workers}: per-worker batch {per_worker} "
                f"keeps the global batch of {BATCH_SIZE * 2}")
        assert said in stderr, logs(tmp_path, stderr)
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_applied"] == NUM_EPOCHS * NUM_SAMPLES and summary["samples_lost"] == 0, summary
    assert summary["samples_redone"] == 0 and summary["num_failures"] == 0, summary
    assert summary["world_size"] == 2 and summary["config"]["training"]["batch_size"] == BATCH_SIZE
    assert summary["steps"] == NUM_EPOCHS * 50, summary
    runs = per_launch_records(tmp_path, stderr)
    assert runs[2][1] == 1, runs  # the leave was mid-epoch 1
    assert_each_sample_once_an_epoch(epochs_trained(tmp_path, runs))
    assert len(list((tmp_path / "records").glob("grown-*"))) == 3
    assert len(list((tmp_path / "records").glob("shrunk-*"))) == 2
