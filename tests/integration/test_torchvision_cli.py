"""`--dataset torchvision:MNIST` trains from the command line, read by torchvision from the
data folder with downloads off: the baseline, and the parameter server with two workers
whose batches come from spawned loader workers. Skipped without torchvision (the `vision`
extra) or without a copy of MNIST."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_torchvision_data import torchvision_layout

SMALL = ["--batch-size", "32", "--num-epochs", "1", "--num-threads", "1", "--max-train-samples", "256",
         "--max-test-samples", "200", "--learning-rate", "0.003", "--set", "training.download=false"]


@pytest.fixture
def torchvision_mnist(tmp_path, real_data_dir):
    folder = torchvision_layout(tmp_path / "tv", real_data_dir, "mnist", "MNIST")
    return ["--dataset", "torchvision:MNIST", "--data-dir", folder]


def run(cli, tmp_path, strategy, *args):
    result = cli(strategy, *SMALL, *args, "--checkpoint-dir", tmp_path / strategy / "ckpt",
                 "--log-dir", tmp_path / strategy / "logs")
    assert result.returncode == 0, result.stderr
    return json.loads((tmp_path / strategy / "logs" / "summary.json").read_text())


@pytest.mark.timeout(120)
def test_the_baseline_trains_on_torchvisions_mnist(tmp_path, cli, torchvision_mnist):
    summary = run(cli, tmp_path, "baseline", *torchvision_mnist)
    assert summary["dataset"] == "torchvision:MNIST" and summary["samples_processed"] == 256
    assert summary["final_accuracy"] > 0.3  # eight steps from chance (0.1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_parameter_server_workers_with_loader_workers_train_on_it(tmp_path, cli, torchvision_mnist):
    summary = run(cli, tmp_path, "ps", *torchvision_mnist, "--workers", "2", "--loader-workers", "1",
                  "--batch-size", "16")  # eight steps, as the baseline's
    assert summary["strategy"] == "ps-sync" and summary["dataset"] == "torchvision:MNIST"
    assert summary["samples_applied"] == 256 and summary["samples_lost"] == 0
    assert summary["final_accuracy"] > 0.3
