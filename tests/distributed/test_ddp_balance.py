"""DDP with unequal ranks: 2 ranks with batches 48 and 16 end with the parameters of one
process stepping on the global batches of 64 (real rank processes on gloo); a measured plan
gives a slowed rank the smaller batch; a straggler appearing mid-run is re-planned around
and the result is still exact; a resumed run keeps the plans it had."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.data import PlannedSampler, load_datasets
from disttrain.metrics.logger import read_metrics
from disttrain.training.engine import train_step
from disttrain.training.models import init_model

SEED = 11
NUM_SAMPLES = 256
LEARNING_RATE = 0.05
SHARES = (48, 16)
TRAINING = {"dataset": "synthetic", "num_samples": NUM_SAMPLES, "model_architecture": "mlp",
            "mlp_hidden_size": 32, "mlp_num_layers": 1, "seed": SEED}

# Speeds measured in the run decide what it does: no other test may share the cores (make test
# runs the `serial` tests after the others, one at a time).
pytestmark = [pytest.mark.timeout(240), pytest.mark.serial]


def ddp_args(tmp_path, *extra):
    return ["ddp", "--world-size", 2, "--dataset", "synthetic", "--num-samples", NUM_SAMPLES,
            "--model", "mlp", "--set", "training.mlp_hidden_size=32", "--set", "training.mlp_num_layers=1",
            "--optimizer", "sgd", "--set", "training.momentum=0", "--learning-rate", LEARNING_RATE,
            "--batch-size", 32, "--seed", SEED, "--set", "training.log_interval=1",
            "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", "--num-threads", 1, *extra]


def reference_model(epochs: int = 1, num_samples: int = NUM_SAMPLES):
    """One process stepping on the global batches of 64, which the plans only split."""
    training = config_from_dict({"training": {**TRAINING, "num_samples": num_samples}}).training
    train_set, _ = load_datasets(training)
    model = init_model(training)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.0)
    whole = PlannedSampler(len(train_set), world_size=1, rank=0, seed=SEED, shares=(sum(SHARES),))
    for epoch in range(epochs):
        whole.set_epoch(epoch)
        for batch in whole.batches():
            train_step(model, optimizer, *train_set.batch(batch))
    return model


@pytest.mark.slow
def test_ranks_of_48_and_16_match_one_process_on_the_concatenated_64(cli, tmp_path):
    result = cli(*ddp_args(tmp_path, "--balance", "proportional", "--set", "system.balance_batches=48,16"),
                 timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = torch.load(tmp_path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    for name, value in reference_model().state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=name)
    logs = [read_metrics(tmp_path / "logs" / f"rank{rank}" / "metrics.jsonl") for rank in (0, 1)]
    steps = [[r for r in log if "loss/train" in r] for log in logs]
    assert len(steps[0]) == len(steps[1]) == NUM_SAMPLES // 64  # equal steps: no rank waits at the end
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_processed"] == NUM_SAMPLES and summary["balance_plans"] == [[0, 0, list(SHARES)]]


@pytest.mark.slow
def test_a_measured_plan_gives_the_slowed_rank_the_smaller_batch(cli, tmp_path):
    result = cli(*ddp_args(tmp_path, "--balance", "proportional", "--inject", "slow:rank=1:factor=4"),
                 timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(ln for ln in result.stderr.splitlines() + result.stdout.splitlines() if "rank speeds" in ln)
    batches = json.loads(line.split("batches ")[1].split(" (")[0])
    assert sum(batches) == 64 and batches[1] < batches[0], line


@pytest.mark.slow
def test_a_straggler_appearing_mid_run_is_re_planned_around_and_the_run_stays_exact(cli, tmp_path):
    result = cli(*ddp_args(tmp_path, "--balance", "auto", "--balance-interval", 2, "--num-samples", 640,
                           "--set", "system.balance_batches=32,32",  # not a measured first plan: noisy
                           "--inject", "slow:rank=1:factor=20:step=3"), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    plans = summary["balance_plans"]
    assert plans[0] == [0, 0, [32, 32]] and summary["balance_replans"] >= 1, plans
    # within a few checks of the slowdown (a 2-step window may also re-plan on noise before it)
    assert any(p[:2] <= [0, 8] and p[2][1] < p[2][0] for p in plans[1:]), plans
    assert plans[-1][2][1] < plans[-1][2][0], plans
    assert "re-planned after step" in result.stderr + result.stdout
    trained = torch.load(tmp_path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    for name, value in reference_model(num_samples=640).state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_resumed_run_keeps_the_plan_it_started_with(cli, tmp_path):
    first = cli(*ddp_args(tmp_path, "--balance", "proportional", "--set", "system.balance_batches=48,16",
                          "--set", "training.checkpoint_interval=2", "--inject", "kill:rank=1:step=3"),
                timeout=200)
    assert first.returncode != 0
    again = cli(*ddp_args(tmp_path, "--balance", "proportional", "--set", "system.balance_batches=32,32",
                          "--set", "training.checkpoint_interval=2", "--resume"), timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["balance_plans"] == [[0, 0, list(SHARES)]]
    trained = torch.load(tmp_path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    for name, value in reference_model().state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=name)
