"""The GPU check's precision comparison (tools/gpu_ddp.py): a mixed-precision run is judged
by its whole training curve and its final accuracy against float32's, which a different
draw of dropout masks leaves close and a broken run does not; its figures are read from
a run's metrics and summary as `disttrain` writes them."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gpu_ddp(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # tools/ is no package: its modules import each other by name
    import gpu_ddp
    yield gpu_ddp
    for name in ("gpu_ddp", "gpu_runs"):
        sys.modules.pop(name, None)


def figures(mean_train_loss: float, final_loss: float, final_accuracy: float) -> dict:
    return {"mean_train_loss": mean_train_loss, "final_loss": final_loss, "final_accuracy": final_accuracy}


# float32 over 128 steps on the CPU, seed 0 (mean training loss, test loss, accuracy)
FP32 = figures(0.7985, 0.1634, 0.953125)


def test_a_run_with_other_dropout_masks_is_close(gpu_ddp):
    # bf16, the same seed, dropout masks drawn from another generator (as CUDA draws a
    # 2-byte tensor's): its final test loss is half float32's again, its curve and accuracy close.
    other_masks = figures(0.8940, 0.0825, 0.96875)
    checks = gpu_ddp.compare_precision(other_masks, FP32)
    assert {name: ok for name, (ok, _) in checks.items()} == {"curve_close": True, "accuracy_close": True}
    # The first check (final test loss within 10%) failed it.
    assert abs(other_masks["final_loss"] - FP32["final_loss"]) > 0.1 * FP32["final_loss"]


@pytest.mark.parametrize(("run", "failed"), [
    (figures(2.30, 2.30, 0.10), {"curve_close", "accuracy_close"}),  # a loss that does not fall
    (figures(1.00, 0.30, 0.92), {"curve_close"}),  # a curve 25% above: learning slower
    (figures(0.80, 0.60, 0.80), {"accuracy_close"}),  # 15 points of accuracy lost
    (figures(math.nan, math.nan, 0.0), {"curve_close", "accuracy_close"}),  # diverged
    (figures(0.80, math.inf, 0.95), {"curve_close", "accuracy_close"}),
])
def test_a_broken_run_fails(gpu_ddp, run, failed):
    checks = gpu_ddp.compare_precision(run, FP32)
    assert {name for name, (ok, _) in checks.items() if not ok} == failed


def test_figures_come_from_the_runs_metrics_and_summary(gpu_ddp, tmp_path):
    rank0 = tmp_path / "logs" / "rank0"
    rank0.mkdir(parents=True)
    losses = [2.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    lines = [{"step": i + 1, "loss/train": loss} for i, loss in enumerate(losses)]
    lines.append({"step": 8, "loss/test": 0.2})  # an evaluation record holds no training loss
    (rank0 / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "logs" / "summary.json").write_text(json.dumps({"final_loss": 0.2, "final_accuracy": 0.9}))
    run = gpu_ddp.Run("fp32", 0, 1.0, "", tmp_path)
    assert gpu_ddp.precision_figures(run) == {"mean_train_loss": sum(losses) / 8,
                                              "train_loss_by_quarter": [2.0, 1.0, 0.5, 0.25],
                                              "final_loss": 0.2, "final_accuracy": 0.9}


def test_a_run_that_logged_nothing_fails(gpu_ddp, tmp_path):
    run = gpu_ddp.precision_figures(gpu_ddp.Run("bf16", 1, 1.0, "", tmp_path))
    assert math.isnan(run["mean_train_loss"]) and run["train_loss_by_quarter"] == []
    assert not any(ok for ok, _ in gpu_ddp.compare_precision(run, FP32).values())
