"""`disttrain ddp --compression-enabled` from the command line: each scheme trains two
ranks to the end, logs its bytes per step and sums them into the summary; a compressed
run killed mid-epoch and resumed with `--resume` ends bit-identical to one never stopped
(its compression state restored on every rank: top-k residuals, stochastic rounding's
draws, PowerSGD's error feedback and warm start, across DDP cutting its buckets anew;
and the learning-rate schedule's step count), and so does one with local updates, its
top-k-compressed pseudo-gradient and its checkpoints in the middle of rounds (each
rank's own model and inner optimizer, the outer momentum and the place in the round)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import VARIANT

from disttrain.metrics.logger import read_metrics

SMALL = ["--world-size", 2, "--dataset", "digits", "--max-train-samples", 256, "--max-test-samples", 64,
         "--num-epochs", 1, "--batch-size", 32, "--seed", 3, "--set", "training.log_interval=1"]
STEPS = 256 // 2 // 32
KEYS = ("compression/bytes_dense", "compression/bytes_sent", "compression/dense_segments",
        "time/compression_s", "compression/ratio")


def dirs(run_dir: Path) -> list:
    return ["--log-dir", run_dir / "logs", "--checkpoint-dir", run_dir / "ckpt"]


def compress(scheme: str) -> list:
    return ["--compression-enabled", "--compression-type", scheme]


def steps_of(run_dir: Path, rank: int) -> list[dict]:
    return [r for r in read_metrics(run_dir / "logs" / f"rank{rank}" / "metrics.jsonl") if "loss/train" in r]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("scheme", "ratio_range"), [
    ("quantization", (3.9, 4.0)),  # one byte per value, plus 8 per tensor
    ("topk", (30, 100)),           # 1% of the values, each with its index, plus 4 bytes per tensor
    ("powersgd", (1.5, 3)),        # steps 1-2 uncompressed, then rank-2 P and Q
    pytest.param("fp16", (2, 2), marks=VARIANT),
    pytest.param("bf16", (2, 2), marks=VARIANT),
])
@pytest.mark.slow
def test_each_scheme_trains_and_counts_its_bytes(cli, tmp_path, scheme, ratio_range):
    result = cli("ddp", *SMALL, *compress(scheme), *dirs(tmp_path), timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    sums = {"dense": 0, "sent": 0}
    for rank in (0, 1):
        steps = steps_of(tmp_path, rank)
        assert len(steps) == STEPS and all(set(KEYS) <= record.keys() for record in steps)
        # comm/bytes_allreduced keeps meaning the dense bucket bytes.
        assert all(r["comm/bytes_allreduced"] == r["compression/bytes_dense"] for r in steps)
        sums["dense"] += sum(r["compression/bytes_dense"] for r in steps)
        sums["sent"] += sum(r["compression/bytes_sent"] for r in steps)
    assert summary["compression_bytes_sent"] == sums["sent"]
    assert summary["compression_ratio"] == pytest.approx(sums["dense"] / sums["sent"])
    low, high = ratio_range
    assert low <= summary["compression_ratio"] <= high
    assert 0 < summary["final_accuracy"] <= 1


@pytest.mark.slow
@pytest.mark.extended
def test_without_compression_the_summary_has_no_compression_fields(cli, tmp_path):
    result = cli("ddp", *SMALL, *dirs(tmp_path), timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert "compression_ratio" not in summary and "compression_bytes_sent" not in summary
    assert not any(key.startswith("compression/") for key in steps_of(tmp_path, 0)[0])


# Two epochs with dropout (per-rank RNG) and Adam; checkpoints every 3 steps, the kill at 5.
RESUMABLE = ["--world-size", 2, "--dataset", "digits", "--max-train-samples", 512, "--max-test-samples",
             64, "--num-epochs", 2, "--batch-size", 32, "--seed", 3, "--optimizer", "adam",
             "--checkpoint-interval", 3, "--set", "training.log_interval=2"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "ckpt" / "ddp_final.pt", weights_only=True)["model"]


# The training features ride along: warm-up then cosine decay, AdamW, clipping of the
# decompressed, averaged gradient (the schedule's step count is in the checkpoint), and
# batches loaded by a worker process per rank.
FEATURES = ["--optimizer", "adamw", "--weight-decay", 0.05, "--lr-schedule", "cosine", "--warmup-steps", 4,
            "--lr-decay-steps", 16, "--lr-min", 1e-4, "--clip-grad-norm", 0.5, "--loader-workers", 1]


LOCAL_UPDATES = ["--sync-every", 4, "--outer-optimizer", "nesterov", "--outer-lr", 0.7,
                 "--outer-momentum", 0.9]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("scheme", "buckets"), [
    ("topk", FEATURES),
    # Buckets of 50 kB (SimpleCNN holds 212 kB): the resumed run's first step has DDP's
    # one initial bucket, the others DDP's rebuilt ones, and PowerSGD's state follows.
    pytest.param("powersgd", ["--set", "ddp.bucket_cap_mb=0.05"], marks=VARIANT),
    # Each tensor draws its rounding noise from (seed, name, payloads taken): the order
    # DDP's buckets come in does not matter.
    pytest.param("quantization", ["--stochastic-rounding", "--set", "ddp.bucket_cap_mb=0.05"],
                 marks=VARIANT),
    # The two-phase int8 all-reduce: both roundings' residuals, kept per parameter, resume.
    pytest.param("quantization", ["--set", "compression.ddp_collective=two_phase"],
                 id="quantization-two-phase", marks=VARIANT),
    # Local updates in rounds of 4 steps (8 per epoch): the checkpoint at step 3 and the kill
    # at step 5 fall inside rounds; every rank's AdamW state and model differ there.
    pytest.param("topk", [*FEATURES, *LOCAL_UPDATES], id="topk-local-updates", marks=VARIANT),
])
@pytest.mark.slow
def test_killed_compressed_run_resumes_bit_identical(cli, tmp_path, scheme, buckets):
    local = "--sync-every" in buckets
    args = [*RESUMABLE, *compress(scheme), "--compression-ratio", 0.05, *buckets]
    reference = cli("ddp", *args, *dirs(tmp_path / "whole"), timeout=100)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = cli("ddp", *args, *dirs(tmp_path / "cut"), "--inject", "kill:rank=1:step=5", timeout=100)
    assert killed.returncode != 0 and "injected fault: kill at step 5" in killed.stderr, killed.stderr[-3000:]
    resumed = cli("ddp", *args, *dirs(tmp_path / "cut"), "--resume", timeout=100)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, trained = final_model(tmp_path / "whole"), final_model(tmp_path / "cut")
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
    whole = json.loads((tmp_path / "whole" / "logs" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "logs" / "summary.json").read_text())
    assert cut["resumed_from_step"] == 3 and cut["steps"] == whole["steps"] == 16
    # The byte totals went on from the checkpoint.
    assert cut["compression_bytes_sent"] == whole["compression_bytes_sent"]
    checkpoint = torch.load(tmp_path / "cut" / "ckpt" / "checkpoint_step00000015.pt", weights_only=True)
    assert len(checkpoint["compression"]) == 2  # every rank's own
    assert checkpoint["schedule"] == {"num_steps": 15}
    if local:  # step 15 is the third of the round of steps 13-16; each rank's model its own
        assert (checkpoint["outer"]["steps_in_round"], checkpoint["outer"]["rounds"]) == (3, 3)
        assert len(checkpoint["local"]) == 2
        assert not torch.equal(*(rank["model/fc2.weight"] for rank in checkpoint["local"]))
        assert cut["local_rounds"] == whole["local_rounds"] == 4
    else:
        assert "outer" not in checkpoint and "local" not in checkpoint
