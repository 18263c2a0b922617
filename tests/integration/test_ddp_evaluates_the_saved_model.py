"""A DDP run's reported accuracy is that of the model it saves. Each rank evaluates a slice
of the test set; the saved model is rank 0's. With BatchNorm, each rank's last forward
updated its own running statistics from its own batch, so a rank evaluating with its own
scored another model than the one saved (`validate` found it: 3 of 359 test samples on
timm's resnet18). Here the statistics are those of the last batch alone (momentum 1), so
the ranks' copies differ as much as two batches do."""

from __future__ import annotations

import json

import pytest

from disttrain.config import load_config
from disttrain.training.evaluation import evaluate_model_file

MODEL = """
import torch.nn as nn

def build(description):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32, momentum=1.0), nn.ReLU(),
                         nn.Linear(32, description.num_classes))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_accuracy_a_ddp_run_reports_is_its_saved_models(cli, tmp_path):
    (tmp_path / "bn_model.py").write_text(MODEL)
    model = f"{tmp_path / 'bn_model.py'}:build"
    result = cli("ddp", "--world-size", 2, "--dataset", "digits", "--model", model, "--batch-size", 16,
                 "--max-train-samples", 320, "--max-test-samples", 300, "--num-epochs", 1, "--learning-rate",
                 "0.05", "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    config = load_config(tmp_path / "logs" / "config.yaml")
    saved = evaluate_model_file(tmp_path / "ckpt" / "ddp_final.pt", config.training)
    assert saved.predictions == 300
    reported = summary["final_accuracy"]
    assert round(saved.accuracy * 300) == round(reported * 300), (saved, reported)
