"""`disttrain ddp --ddp-recovery live` when every rank dies at once while the launcher
lives: no member is left to take the restarted ranks back, so they start the next
generation themselves from the newest checkpoint (none yet: from the run's start) and
train to the end; the ledger of the run's last checkpoint shows every global batch
applied exactly once, and the model learns as an undisturbed run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.data import load_datasets

WORLD_SIZE, BATCH, EPOCHS, INTERVAL = 2, 16, 3, 12
# An MLP (no dropout, no BatchNorm): a step's gradient is the same whatever the split of
# its global batch over the ranks, up to float rounding.
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 3, "--timeout-s", 60,
        "--checkpoint-interval", INTERVAL, "--num-threads", 1, "--max-restarts", 1,
        "--set", "training.model_architecture=mlp",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1.5"]


def steps_per_epoch() -> int:
    train_set, _ = load_datasets(TrainingConfig(dataset="digits"))
    return len(train_set) // (BATCH * WORLD_SIZE)


def dirs(folder: Path) -> list:
    return ["--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt"]


def every_rank_killed_at(step: int) -> list:
    return [arg for slot in range(WORLD_SIZE) for arg in ("--inject", f"kill:rank={slot}:step={step}")]


def newest_ledger(folder: Path) -> torch.Tensor:
    newest = sorted((folder / "ckpt").glob("checkpoint_step*.pt"))[-1]
    return torch.load(newest, weights_only=True)["ledger"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict:
    from tests.conftest import run_cli
    folder = tmp_path_factory.mktemp("undisturbed")
    result = run_cli("ddp", *ARGS, *dirs(folder), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


def check_finished(folder: Path, undisturbed: dict) -> dict:
    """The run went on to the end in the restarted processes, every global batch applied
    once (the summary's count, and the ledger of its last checkpoint)."""
    summary = json.loads((folder / "logs" / "summary.json").read_text())
    assert summary["steps"] == undisturbed["steps"] == EPOCHS * steps_per_epoch()
    assert summary["samples_applied"] == undisturbed["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    ledger = newest_ledger(folder)
    assert ledger.shape == (EPOCHS, steps_per_epoch()) and bool((ledger == 1).all())
    # Every rank was started again once, and those processes finished the run: the group's
    # last members are restarted processes. Which slots are in it depends on the clock: the
    # first restarted rank trains on at once, and one that comes back only after the last
    # step (a loaded machine) finds the run over.
    pids = summary["rank_pids"]
    assert all(len(pids[str(slot)]) == 2 for slot in range(WORLD_SIZE))
    final = summary["final_pids"]
    assert final and all(pid == pids[slot][1] for slot, pid in final.items()), (final, pids)
    assert abs(summary["final_accuracy"] - undisturbed["final_accuracy"]) <= 0.005
    return summary


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_rank_killed_at_once_restarts_the_group_from_its_newest_checkpoint(cli, tmp_path, undisturbed):
    kill_at = steps_per_epoch() + 10  # mid-epoch 1, after the checkpoints of steps 12 to 36
    result = cli("ddp", *ARGS, *dirs(tmp_path), *every_rank_killed_at(kill_at), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = check_finished(tmp_path, undisturbed)
    restores = [r for r in summary["live_recoveries"] if r["kind"] == "restore"]
    assert len(restores) == 1
    # From a checkpoint the dead group wrote (the newest, unless its last write was cut short).
    step = restores[0]["step"]
    assert 0 < step <= kill_at and step % INTERVAL == 0 and kill_at - step < 2 * INTERVAL
    leader = f"rank{restores[0]['members'][0]}.log"
    assert f"checkpoint_step{step:08d}.pt (step {step})" in (tmp_path / "logs" / leader).read_text()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended  # the group's restart: the test above
def test_every_rank_killed_before_the_first_checkpoint_starts_the_run_again(cli, tmp_path, undisturbed):
    result = cli("ddp", *ARGS, *dirs(tmp_path), *every_rank_killed_at(INTERVAL // 2), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = check_finished(tmp_path, undisturbed)
    restores = [r for r in summary["live_recoveries"] if r["kind"] == "restore"]
    assert [r["step"] for r in restores] == [0]
