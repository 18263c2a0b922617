"""Real MNIST, one epoch, 2 workers: each aggregation mode reaches 97% test accuracy (slow)."""

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [["sync"], ["async"], ["ssp", "--staleness", "2"]], ids=lambda m: m[0])
def test_one_mnist_epoch_reaches_97_percent(tmp_path, cli, real_data_dir, mode):
    result = cli(
        "ps",
        "--workers",
        "2",
        "--dataset",
        "mnist",
        "--data-dir",
        real_data_dir,
        "--num-epochs",
        "1",
        "--aggregation-mode",
        *mode,
        "--log-dir",
        tmp_path / "logs",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        timeout=580,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["strategy"] == f"ps-{mode[0]}"
    assert summary["final_accuracy"] >= 0.97, summary["final_accuracy"]
    evaluated = cli(
        "evaluate",
        "--dataset",
        "mnist",
        "--data-dir",
        real_data_dir,
        tmp_path / "ckpt" / "parameter_server_final.pt",
    )
    assert f"Test Accuracy: {summary['final_accuracy'] * 100:.2f}%" in evaluated.stdout
