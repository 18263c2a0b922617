"""`disttrain ddp --resume` on another number of ranks: a 2-rank run preempted mid-epoch
(`--inject term:...`) goes on on 3 ranks (preempted again there) and then on 1, or on 1
at once. Every sample of each epoch is trained exactly once across the changes (read from
what the model's forward was given, in every rank process of every run), the global
batch is kept (per-rank batch = B·N/M), and the runs finish. A size that cannot keep the
global batch is refused before any rank starts (exit 2)."""

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

# 2 ranks x 6: a global batch of 12. 500 steps an epoch: a stop asked at step s comes within
# two rounds of the ranks' stop agreement (at most 100 steps each), well inside the epoch.
NUM_SAMPLES, BATCH_SIZE, NUM_EPOCHS = 6000, 6, 2

# A data set whose first feature is the sample's index, and a model that records, in the
# rank processes only (torchrun sets RANK), the indices of every training forward, and
# "eval" at each evaluation (an epoch's end), one file per process.
PLUGIN = '''
import os
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
        if folder and "RANK" in os.environ:
            name = f"{os.environ['RUN_LABEL']}-rank{os.environ['RANK']}-{os.getpid()}"
            self.path = os.path.join(folder, name)

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

STOPPED = re.compile(r"^error: preempted at step (\d+): every rank stopped there")


def config_file(path: Path) -> Path:
    plugin = path / "indexed.py"
    plugin.write_text(PLUGIN)
    config = path / "run.yaml"
    config.write_text(yaml.safe_dump({"training": {
        "model_architecture": f"{plugin}:model", "dataset": f"{plugin}:data", "optimizer": "sgd",
        "learning_rate": 0.05, "batch_size": BATCH_SIZE, "num_epochs": NUM_EPOCHS, "seed": 5,
        "checkpoint_interval": 1000}, "ddp": {"lr_scaling": "linear"}}))  # 0.05 x 2 ranks
    return config


def ddp(path: Path, label: str, world_size: int, *args):
    records = path / "records"
    records.mkdir(exist_ok=True)
    return run_cli("ddp", "--config", path / "run.yaml", "--world-size", world_size, "--num-threads", 1,
                   "--log-dir", path / "logs", "--checkpoint-dir", path / "ckpt", *args,
                   env={"RESIZE_RECORDS": str(records), "RUN_LABEL": label}, timeout=200)


def stopped_at(result, path: Path) -> int:
    """The step the run stopped at; its checkpoint is mid-epoch 0."""
    assert result.returncode == 143, result.stderr[-3000:]
    match = STOPPED.match(result.stderr.strip().splitlines()[-1])
    assert match, result.stderr[-3000:]
    step = int(match.group(1))
    state = ckpt.load_checkpoint(path / "ckpt" / ckpt.checkpoint_name(step))
    assert state["position"]["epoch"] == 0 and state["sampler"]["position"] > 0
    return step


def epochs_trained(path: Path, runs: list[tuple[str, int]]) -> list[Counter]:
    """Per epoch, how many times each index was trained, over every rank process of the
    `(label, first epoch)` runs: a process's records before its first evaluation are its
    first epoch's, and so on."""
    counts = [Counter() for _ in range(NUM_EPOCHS)]
    for label, first_epoch in runs:
        files = sorted((path / "records").glob(f"{label}-rank*"))
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


def summary_of(path: Path) -> dict:
    return json.loads((path / "logs" / "summary.json").read_text())


def batch_line(result, written: int, world_size: int) -> None:
    per_rank = BATCH_SIZE * 2 // world_size
    line = (f"resuming a checkpoint of {written} ranks on {world_size}: per-rank batch {per_rank} keeps "
            f"the global batch of {BATCH_SIZE * 2}")
    assert line in result.stderr, result.stderr[-3000:]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, int]:
    """A 2-rank run preempted mid-epoch 0 (its records labelled `two`)."""
    path = tmp_path_factory.mktemp("two")
    config_file(path)
    step = stopped_at(ddp(path, "two", 2, "--inject", "term:rank=1:step=5"), path)
    assert step >= 5
    return path, step


def copy_of(stopped: tuple[Path, int], tmp_path: Path) -> Path:
    path = tmp_path / "run"
    shutil.copytree(stopped[0], path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_resumed_on_three_then_on_one_train_every_sample_once(stopped, tmp_path):
    path = copy_of(stopped, tmp_path)
    three = ddp(path, "three", 3, "--resume", "--inject", f"term:rank=2:step={stopped[1] + 10}")
    second_stop = stopped_at(three, path)  # still within epoch 0's re-split
    batch_line(three, 2, 3)
    assert second_stop >= stopped[1] + 10
    one = ddp(path, "one", 1, "--resume")
    assert one.returncode == 0, one.stderr[-3000:]
    batch_line(one, 3, 1)
    assert_each_sample_once_an_epoch(epochs_trained(path, [("two", 0), ("three", 0), ("one", 0)]))
    summary = summary_of(path)
    assert summary["world_size"] == 1 and summary["config"]["training"]["batch_size"] == 2 * BATCH_SIZE
    assert summary["resized_from_world_size"] == 3
    assert summary["samples_processed"] == NUM_EPOCHS * NUM_SAMPLES


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.extended  # resumed on one: the test above
def test_two_ranks_resumed_on_one_train_every_sample_once_and_a_size_off_the_batch_is_refused(
        stopped, tmp_path):
    path = copy_of(stopped, tmp_path)
    refused = ddp(path, "five", 5, "--resume")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: system.num_workers: the checkpoint's global batch of 12 (2 ranks x 6) does not divide "
        "over 5 ranks; resume with --world-size in 1, 2, 3, 4, 6, 12 (each keeps it)")
    assert not list((path / "records").glob("five-*"))  # no rank started
    one = ddp(path, "one", 1, "--resume")
    assert one.returncode == 0, one.stderr[-3000:]
    batch_line(one, 2, 1)
    assert_each_sample_once_an_epoch(epochs_trained(path, [("two", 0), ("one", 0)]))
    summary = summary_of(path)
    assert summary["config"]["training"]["batch_size"] == 2 * BATCH_SIZE
    assert summary["samples_processed"] == NUM_EPOCHS * NUM_SAMPLES
    assert summary["resumed_from_step"] == stopped[1]
    # The rate goes on as the 2 ranks' linear scaling set it (the global batch is kept), not 0.05 x 1.
    newest = ckpt.load_checkpoint(ckpt.list_checkpoints(path / "ckpt")[-1])
    assert [group["lr"] for group in newest["optimizer"]["param_groups"]] == pytest.approx([0.1, 0.1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compressed_run_resumed_on_another_size_drops_the_old_ranks_residuals(tmp_path):
    config_file(tmp_path)
    topk = ["--compression-enabled", "--compression-type", "topk"]
    step = stopped_at(ddp(tmp_path, "two", 2, *topk, "--inject", "term:rank=0:step=5"), tmp_path)
    state = ckpt.load_checkpoint(tmp_path / "ckpt" / ckpt.checkpoint_name(step))
    assert len(state["compression"]) == 2  # each old rank's residuals, in the checkpoint
    one = ddp(tmp_path, "one", 1, *topk, "--resume")
    assert one.returncode == 0, one.stderr[-3000:]
    assert ("compression residuals of the 2 old ranks dropped: they belong to ranks that are gone "
            "(error feedback starts again from zero)") in one.stderr
    assert "each rank's RNG re-derived from the seed" in one.stderr
    assert_each_sample_once_an_epoch(epochs_trained(tmp_path, [("two", 0), ("one", 0)]))
    assert summary_of(tmp_path)["compression_bytes_sent"] > 0
