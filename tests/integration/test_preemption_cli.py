"""A baseline run preempted: SIGTERM (here sent by the process to itself at a chosen step,
`--inject term:worker=0:step=N`, through the same handler a scheduler's signal meets) stops
it at that step's end with a checkpoint of the step, exit code 143 and a line that says to
resume; `--resume` then ends bit for bit where an uninterrupted run does. At an epoch's
last step the stop comes after the epoch's evaluation and checkpoint, so the resumed run
evaluates no epoch twice."""

import json

import pytest
import torch

from disttrain.core import checkpoint as ckpt
from disttrain.metrics.logger import read_metrics

ARGS = ["--dataset", "digits", "--max-train-samples", "512", "--batch-size", "32", "--num-epochs", "2",
        "--num-threads", "1", "--checkpoint-interval", "1000", "--seed", "5"]
STEPS_PER_EPOCH = 512 // 32


def folders(path):
    return ["--log-dir", path / "logs", "--checkpoint-dir", path / "ckpt"]


def final_model(path):
    return torch.load(path / "ckpt" / "baseline_final.pt", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("step", [5, pytest.param(STEPS_PER_EPOCH, marks=pytest.mark.extended)],
                         ids=["mid-epoch", "epoch-end"])
def test_a_preempted_baseline_stops_with_a_checkpoint_and_resumes_bit_identical(tmp_path, cli, step):
    whole = cli("baseline", *ARGS, *folders(tmp_path / "whole"), timeout=120)
    assert whole.returncode == 0, whole.stderr[-3000:]

    cut = tmp_path / "cut"
    stopped = cli("baseline", *ARGS, *folders(cut), "--inject", f"term:worker=0:step={step}", timeout=120)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"error: stopped by SIGTERM after step {step}, with its checkpoint ({ckpt.checkpoint_name(step)}); "
        "run the same command with --resume to go on")
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(cut / "ckpt")] == [step]

    resumed = cli("baseline", *ARGS, *folders(cut), "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, trained = final_model(tmp_path / "whole"), final_model(cut)
    assert expected.keys() == trained.keys() and all(torch.equal(expected[k], trained[k]) for k in expected)
    summary = json.loads((cut / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["steps"] == 2 * STEPS_PER_EPOCH
    records = read_metrics(cut / "logs" / "baseline" / "metrics.jsonl")
    evaluations = [r for r in records if "accuracy/test" in r]
    assert [r["epoch"] for r in evaluations] == [0, 1]  # each epoch evaluated once
