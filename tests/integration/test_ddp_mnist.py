"""Real MNIST, 2 ranks on gloo, one epoch: at least 98% test accuracy, and the final model
file is one `disttrain evaluate` reads. Slow; skips without a local MNIST copy."""

from __future__ import annotations

import json

import pytest

from disttrain.config import config_from_dict
from disttrain.training.evaluation import evaluate_model_file


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_reach_98_percent_on_mnist_in_one_epoch(cli, tmp_path, real_data_dir):
    result = cli("ddp", "--world-size", 2, "--dataset", "mnist", "--data-dir", real_data_dir,
                 "--num-epochs", 1, "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=840)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2
    assert summary["final_accuracy"] >= 0.98, summary["final_accuracy"]
    assert summary["samples_processed"] == 60_000

    training = config_from_dict({"training": {"dataset": "mnist",
                                              "data_dir": str(real_data_dir)}}).training
    evaluated = evaluate_model_file(tmp_path / "ckpt" / "ddp_final.pt", training)
    assert evaluated.accuracy == summary["final_accuracy"]
