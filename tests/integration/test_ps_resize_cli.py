"""`disttrain ps --resume` on another number of workers: a 2-worker synchronous run
preempted mid-epoch (`--inject term:worker=1:step=S`) goes on on 3 workers, or on 1, or on 3
preempted again within the epoch and then on 1. Every
sample of each epoch is applied exactly once across the change (the shards' ledgers, through
the summary, and what the model's forward was given in every worker process of both runs),
the global batch is kept (per-worker batch = B·N/M, said in the launcher's log), and the
run finishes. A number of workers that cannot keep the global batch is refused before any
process starts (exit 2), as is a resume in another aggregation mode (async and SSP
runs resized: `test_ps_resize_async_cli`)."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from disttrain.core import checkpoint as ckpt

# 2 workers x 6: a global batch of 12, which 3 and 1 workers keep (4 and 12 each); 50
# steps an epoch on any of them. The stop comes in epoch 1, so the ledger renumbered
# holds a whole epoch and part of one.
NUM_SAMPLES, BATCH_SIZE, NUM_EPOCHS, STOP_STEP = 600, 6, 2, 60

# A data set whose first feature is the sample's index, and a model that records, in the
# worker processes only, the indices of every training forward and "eval" at each
# evaluation (an epoch's end), one file per process.
PLUGIN = '''
import os
import sys
import torch
from torch import nn


class Indexed(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(count, 4, generator=generator)
        self.x = torch.cat([torch.arange(count, dtype=torch.float32)[:, None], features], dim=1)
        self.y = (features.sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], int(self.y[index])


def data():
    description = {"task": "classification", "input_shape": [5], "num_classes": 2}
    return Indexed(NUM_TRAIN, 0), Indexed(24, 1), description


class Recording(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        folder = os.environ.get("RESIZE_RECORDS")
        self.path = None
        if folder and "ps-worker" in sys.argv:
            self.path = os.path.join(folder, f"{os.environ['RUN_LABEL']}-{os.getpid()}")

    def forward(self, x):
        if self.path is not None:
            with open(self.path, "a") as records:
                if self.training:
                    records.write(" ".join(str(int(i)) for i in x[:, 0].tolist()) + "\\n")
                else:
                    records.write("eval\\n")
        return self.linear(x[:, 1:])


def model(description):
    return Recording()
'''.replace("NUM_TRAIN", str(NUM_SAMPLES))

STOPPED = re.compile(r"^error: preempted by SIGTERM: checkpoints written at step (\d+) ")


def config_file(path: Path) -> Path:
    plugin = path / "indexed.py"
    plugin.write_text(PLUGIN)
    config = path / "run.yaml"
    config.write_text(yaml.safe_dump({"training": {
        "model_architecture": f"{plugin}:model", "dataset": f"{plugin}:data", "optimizer": "sgd",
        "learning_rate": 0.05, "batch_size": BATCH_SIZE, "num_epochs": NUM_EPOCHS, "seed": 5,
        "checkpoint_interval": 1000}}))
    return config


def ps(path: Path, label: str, workers: int, *args):
    records = path / "records"
    records.mkdir(exist_ok=True)
    # On a loaded machine a worker must not be declared failed by its heartbeats: a failure
    # and its restart would redo steps, and these runs have none.
    return run_cli("ps", "--config", path / "run.yaml", "--workers", workers, "--servers", 2,
                   "--num-threads", 1, "--heartbeat-timeout", 60, "--log-dir", path / "logs",
                   "--checkpoint-dir", path / "ckpt", *args,
                   env={"RESIZE_RECORDS": str(records), "RUN_LABEL": label}, timeout=200)


def logs(path: Path, result) -> str:
    parts = [f"--- launcher ---\n{result.stderr[-3000:]}"]
    for log in sorted((path / "logs").glob("*.log")):
        parts.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def epochs_trained(path: Path, runs: list[tuple[str, int]]) -> list[Counter]:
    """Per epoch, how many times each index was trained, over every worker process of the
    `(label, first epoch)` runs: a process's records before its first evaluation are its
    first epoch's, and so on."""
    counts = [Counter() for _ in range(NUM_EPOCHS)]
    for label, first_epoch in runs:
        files = sorted((path / "records").glob(f"{label}-*"))
        assert files, f"no records of run {label}"
        for file in files:
            epoch, evaluating = first_epoch, False
            for line in file.read_text().splitlines():
                if line == "eval":
                    epoch += 0 if evaluating else 1
                    evaluating = True
                    continue
                evaluating = False
                counts[epoch].update(int(i) for i in line.split())
    return counts


def assert_each_sample_once_an_epoch(counts: list[Counter]) -> None:
    for epoch, count in enumerate(counts):
        lost = set(range(NUM_SAMPLES)) - set(count)
        assert not lost and set(count) <= set(range(NUM_SAMPLES)), f"epoch {epoch}: lost {lost}"
        twice = {index: n for index, n in count.items() if n != 1}
        assert not twice, f"epoch {epoch}: trained more than once: {twice}"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, int]:
    """A 2-worker run preempted mid-epoch 1 (its records labelled `two`)."""
    path = tmp_path_factory.mktemp("two")
    config_file(path)
    result = ps(path, "two", 2, "--inject", f"term:worker=1:step={STOP_STEP}")
    assert result.returncode == 143, logs(path, result)
    match = STOPPED.match(result.stderr.strip().splitlines()[-1])
    assert match, logs(path, result)
    step = int(match.group(1))
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(path / "ckpt" / "worker0")[-1])
    assert state["position"]["epoch"] == 1 and 0 < state["sampler"]["position"] < NUM_SAMPLES // 2
    return path, step


def batch_line(result, path: Path, written: int, workers: int) -> None:
    per_worker = BATCH_SIZE * 2 // workers
    assert (f"resuming a checkpoint of {written} workers on {workers}: per-worker batch {per_worker} keeps "
            f"the global batch of {BATCH_SIZE * 2}") in result.stderr, logs(path, result)


def finished(path: Path, result, workers: int, resumed_from: int | None, runs: list[tuple[str, int]],
             steps: int = NUM_EPOCHS * 50) -> dict:
    """The run finished on `workers` after `steps` (sync: steps of the run; async and
    SSP: pushes applied), resumed from step `resumed_from` (None: not checked), every
    sample of each epoch applied once, from the ledgers and the forwards of the `runs`;
    its summary."""
    assert result.returncode == 0, logs(path, result)
    summary = json.loads((path / "logs" / "summary.json").read_text())
    assert summary["samples_applied"] == NUM_EPOCHS * NUM_SAMPLES and summary["samples_lost"] == 0, summary
    assert summary["samples_redone"] == 0 and summary["num_failures"] == 0, summary
    per_worker = BATCH_SIZE * 2 // workers
    assert summary["world_size"] == workers and summary["config"]["training"]["batch_size"] == per_worker
    assert resumed_from in (None, summary["resumed_from_step"]) and summary["steps"] == steps, summary
    assert summary["samples_processed"] == NUM_EPOCHS * NUM_SAMPLES, summary
    assert_each_sample_once_an_epoch(epochs_trained(path, runs))
    return summary


def resumed_on(stopped: tuple[Path, int], tmp_path: Path, workers: int) -> tuple[Path, dict]:
    """The stopped run resumed on `workers`: it finishes, and its launcher says the per-worker batch."""
    path = tmp_path / "run"
    shutil.copytree(stopped[0], path)
    result = ps(path, "resumed", workers, "--resume")
    batch_line(result, path, 2, workers)
    return path, finished(path, result, workers, stopped[1], [("two", 0), ("resumed", 1)])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.extended  # resumed on three: the last test of this file
def test_two_workers_resumed_on_three_apply_every_sample_once(stopped, tmp_path):
    path, _ = resumed_on(stopped, tmp_path, 3)
    assert len(list((path / "records").glob("resumed-*"))) == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_resumed_on_one_apply_every_sample_once_and_sizes_off_the_batch_are_refused(
        stopped, tmp_path):
    path = tmp_path / "refused"
    shutil.copytree(stopped[0], path)
    refused = ps(path, "five", 5, "--resume")
    assert refused.returncode == 2, logs(path, refused)
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: system.num_workers: the checkpoint's global batch of 12 (2 workers x 6) does not divide "
        "over 5 workers; resume with --workers in 1, 2, 3, 4, 6, 12 (each keeps it)")
    async_mode = ps(path, "async", 3, "--resume", "--aggregation-mode", "async")
    assert async_mode.returncode == 2, logs(path, async_mode)
    assert async_mode.stderr.strip().splitlines()[-1] == (
        "error: ps.aggregation_mode: the checkpoint was written in sync mode and this run is async; resume "
        "with --aggregation-mode sync")
    assert not list((path / "records").glob("five-*")) and not list((path / "records").glob("async-*"))
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(path / "ckpt" / "worker0")] == [stopped[1]]
    _, summary = resumed_on(stopped, tmp_path, 1)
    assert [w["rank"] for w in summary["workers"]] == [0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_resumed_on_three_preempted_again_then_on_one_apply_every_sample_once(stopped, tmp_path):
    # The second stop is within epoch 1 too: its re-split epoch is re-split again.
    path = tmp_path / "run"
    shutil.copytree(stopped[0], path)
    three = ps(path, "three", 3, "--resume", "--inject", "term:worker=2:step=64")
    assert three.returncode == 143, logs(path, three)
    batch_line(three, path, 2, 3)
    match = STOPPED.match(three.stderr.strip().splitlines()[-1])
    assert match, logs(path, three)
    second = int(match.group(1))
    assert 64 <= second < 100
    one = ps(path, "one", 1, "--resume")
    batch_line(one, path, 3, 1)
    finished(path, one, 1, second, [("two", 0), ("three", 1), ("one", 1)])
