"""Streaming DiLoCo from the command line (`disttrain ddp --sync-every 4 --set
training.outer_fragments=F`), two ranks on digits: the run trains; each exchange carries
one fragment (the fragments partition the model, each exchanged at steps of its own,
every fragment at an epoch's end), so the largest exchange is about 1/F of the model
(SimpleCNN's first linear layer, 62% of it, is cut across fragments); int8
pseudo-gradients send about a quarter of the dense bytes; and a run killed inside the
rounds and resumed with `--resume` ends bit-identical to one never stopped (every
fragment's round start, outer momentum and place in its round, every rank's own model,
inner optimizer and error-feedback residuals, in the checkpoint). With a delay
(`training.outer_delay`) the exchanges start at the same steps and carry the same bytes,
and the checkpoint taken while one is in flight keeps its average and steps left (the
kill and resume fall across one: sent at step 2, checkpoint at 3, landing after 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disttrain.config import load_config
from disttrain.metrics.logger import read_metrics
from disttrain.training.models import count_parameters, init_model

# Two epochs of 8 steps per rank, rounds of 4, Adam inside the rounds, dropout (per-rank
# RNG), Nesterov outside; checkpoints every 3 steps, the kill at step 5.
ARGS = ["--world-size", 2, "--dataset", "digits", "--max-train-samples", 512, "--max-test-samples", 64,
        "--num-epochs", 2, "--batch-size", 32, "--seed", 3, "--optimizer", "adam",
        "--checkpoint-interval", 3, "--set", "training.log_interval=1",
        "--sync-every", 4, "--outer-optimizer", "nesterov", "--outer-lr", 0.7, "--outer-momentum", 0.9]
STEPS_PER_EPOCH, NUM_STEPS = 8, 16


def dirs(run_dir: Path) -> list:
    return ["--log-dir", run_dir / "logs", "--checkpoint-dir", run_dir / "ckpt"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "ckpt" / "ddp_final.pt", weights_only=True)["model"]


def steps_of(run_dir: Path, rank: int) -> list[dict]:
    return [r for r in read_metrics(run_dir / "logs" / f"rank{rank}" / "metrics.jsonl") if "loss/train" in r]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("num_fragments", "extra"), [
    # make test-extended: the plain outer step (mixing 0) on two fragments; make test runs
    # the same stop and resume with four compressed fragments and with two delayed ones.
    pytest.param(2, [], id="fragments-2", marks=pytest.mark.extended),
    (4, ["--set", "training.outer_compression=int8", "--set", "training.outer_mixing=0.5"]),
    (2, ["--set", "training.outer_delay=2", "--set", "training.outer_mixing=0.5"]),
], ids=["fragments-2", "fragments-4-int8-mixing", "fragments-2-delay-2-mixing"])
def test_streaming_run_exchanges_fragments_and_resumes_bit_identical(cli, tmp_path, num_fragments, extra):
    args = [*ARGS, "--set", f"training.outer_fragments={num_fragments}", *extra]
    reference = cli("ddp", *args, *dirs(tmp_path / "whole"), timeout=150)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert f"streaming: {num_fragments} fragment(s) at staggered steps" in reference.stderr

    # Each exchange inside an epoch is one fragment's; the fragments partition the model.
    training = load_config(tmp_path / "whole" / "logs" / "config.yaml").training
    model_bytes = 4 * count_parameters(init_model(training))
    steps = steps_of(tmp_path / "whole", 0)
    assert [r["step"] for r in steps] == list(range(1, NUM_STEPS + 1))
    epoch_ends = {STEPS_PER_EPOCH, NUM_STEPS}
    inside = {r["step"]: r["comm/bytes_allreduced"] for r in steps
              if r["step"] not in epoch_ends and r["comm/bytes_allreduced"]}
    # Fragment f ends its rounds at steps f * H / F (+ H), fragment 0 at H, in each epoch.
    first_epoch = {2: [2, 4, 6], 4: [1, 2, 3, 4, 5, 6, 7]}[num_fragments]
    assert sorted(step for step in inside if step < STEPS_PER_EPOCH) == first_epoch
    assert sorted(step - STEPS_PER_EPOCH for step in inside if step > STEPS_PER_EPOCH) == first_epoch
    # The first F exchanges are every fragment once: the model, about 1/F of it each.
    assert sum(inside[step] for step in first_epoch[:num_fragments]) == model_bytes
    assert all(r["local/exchange_bytes"] == r["comm/bytes_allreduced"] for r in steps
               if r["step"] not in epoch_ends)
    for step in epoch_ends:  # every fragment, one exchange each
        record = steps[step - 1]
        assert record["comm/bytes_allreduced"] == model_bytes
        assert record["local/exchange_bytes"] == max(inside.values())
    peak = max(r["local/exchange_bytes"] for r in steps)
    assert model_bytes / num_fragments <= peak <= 1.1 * model_bytes / num_fragments
    compressed, delay = "training.outer_compression=int8" in extra, "training.outer_delay=2" in extra
    if delay:
        assert "each exchange overlapped with the next 2 step(s)" in reference.stderr
    if compressed:  # one byte per value, plus 8 per tensor (the smallest go dense)
        sent = sum(r["compression/bytes_sent"] for r in steps)
        dense = sum(r["compression/bytes_dense"] for r in steps)
        assert dense == sum(r["comm/bytes_allreduced"] for r in steps)
        assert 3.5 < dense / sent <= 4
    summary = json.loads((tmp_path / "whole" / "logs" / "summary.json").read_text())
    assert summary["outer_fragments"] == num_fragments and summary["local_rounds"] == 4
    assert summary["outer_delay"] == (2 if delay else 0)
    assert 0 < summary["final_accuracy"] <= 1

    killed = cli("ddp", *args, *dirs(tmp_path / "cut"), "--inject", "kill:rank=1:step=5", timeout=150)
    assert killed.returncode != 0 and "injected fault: kill at step 5" in killed.stderr, killed.stderr[-3000:]
    resumed = cli("ddp", *args, *dirs(tmp_path / "cut"), "--resume", timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, trained = final_model(tmp_path / "whole"), final_model(tmp_path / "cut")
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
    cut = json.loads((tmp_path / "cut" / "logs" / "summary.json").read_text())
    assert cut["resumed_from_step"] == 3 and cut["steps"] == summary["steps"] == NUM_STEPS
    checkpoint = torch.load(tmp_path / "cut" / "ckpt" / "checkpoint_step00000015.pt", weights_only=True)
    outer = checkpoint["outer"]
    assert outer["num_fragments"] == num_fragments and len(outer["fragments"]) == num_fragments
    # Step 15 is the 7th of epoch 2: fragment 0's round began after step 12, 3 steps ago.
    assert outer["fragments"][0]["steps_in_round"] == 3
    assert len(checkpoint["local"]) == 2  # every rank's own
    # Fragment 1's exchange sent at step 14 lands after step 16: one step left.
    in_flight = [(e["fragment"], e["steps_left"]) for e in outer.get("in_flight", [])]
    assert in_flight == ([(1, 1)] if delay else [])
    if compressed:
        assert any(name.startswith("outer_compression/") for name in checkpoint["local"][0])
