"""A live run that loses every rank at once (no survivor to take state from) resumes from
the checkpoints its group's leader wrote: `--resume` ends with the same final model as an
undisturbed run of the same seed, and the ledger carried in the checkpoint shows every
global batch applied exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.data import load_datasets

WORLD_SIZE, BATCH, EPOCHS, INTERVAL = 2, 16, 3, 15
ARGS = ["--world-size", WORLD_SIZE, "--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 60,
        "--checkpoint-interval", INTERVAL,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=1"]


def steps_per_epoch() -> int:
    train_set, _ = load_datasets(TrainingConfig(dataset="digits"))
    return len(train_set) // (BATCH * WORLD_SIZE)


def dirs(folder: Path) -> list:
    return ["--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt"]


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "ckpt" / "ddp_final.pt", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended  # a live run resumed: test_ddp_live_elastic_cli, test_ddp_live_elastic_resume_cli
def test_whole_run_crash_resumes_from_the_leaders_checkpoint(cli, tmp_path):
    reference = tmp_path / "reference"
    result = cli("ddp", *ARGS, *dirs(reference), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = json.loads((reference / "logs" / "summary.json").read_text())
    total_steps = EPOCHS * steps_per_epoch()
    assert expected["steps"] == total_steps
    written = sorted(p.name for p in (reference / "ckpt").glob("checkpoint_step*.pt"))
    assert written and written[-1] == f"checkpoint_step{total_steps:08d}.pt"  # a finished run's holds it all

    # Every rank dies after step 40 (mid-epoch 2; checkpoints at 15 and 30) and none is
    # started again: nothing is left to recover live, the launcher ends with an error.
    crashed = tmp_path / "crashed"
    kill_at = steps_per_epoch() + 10
    faults = [arg for slot in range(WORLD_SIZE) for arg in ("--inject", f"kill:rank={slot}:step={kill_at}")]
    result = cli("ddp", *ARGS, *dirs(crashed), "--max-restarts", 0, *faults, timeout=150)
    assert result.returncode == 1, result.stderr[-3000:]
    assert not (crashed / "logs" / "summary.json").exists()
    left = sorted(p.name for p in (crashed / "ckpt").glob("checkpoint_step*.pt"))
    assert left and left[-1] <= f"checkpoint_step{kill_at:08d}.pt"

    result = cli("ddp", *ARGS, *dirs(crashed), "--resume", timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((crashed / "logs" / "summary.json").read_text())
    assert summary["steps"] == total_steps
    assert summary["samples_applied"] == expected["samples_applied"]
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert "--resume: taking the run's state from" in (crashed / "logs" / "rank0.log").read_text()
    # Same seed, same world size, same split of every global batch: the same model.
    trained, wanted = final_model(crashed), final_model(reference)
    assert trained.keys() == wanted.keys()
    assert all(torch.equal(trained[name], wanted[name]) for name in wanted)
    assert summary["final_accuracy"] == expected["final_accuracy"]
