"""`disttrain ddp` and `torchrun -m disttrain.torchrun` as a user runs them: the torchrun entry,
exact resume after a rank is SIGKILLed mid-epoch and restarted by the elastic agent, and
bad input refused with one line and no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disttrain.metrics.logger import read_metrics

# Small, but with dropout (per-rank RNG) and Adam (optimizer state) to restore.
TRAINING = ["--dataset", "synthetic", "--num-samples", 512, "--batch-size", 32, "--num-epochs", 2,
            "--checkpoint-interval", 5, "--seed", 3, "--set", "training.log_interval=2"]
STEPS = 2 * 512 // 2 // 32


def torchrun_command() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "ckpt" / "ddp_final.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """An uninterrupted run started by torchrun itself (also the reference for resume)."""
    run_dir = tmp_path_factory.mktemp("torchrun")
    command = [*torchrun_command(), "--standalone", "--nproc-per-node", "2", "-m", "disttrain.torchrun",
               *map(str, TRAINING), "--log-dir", str(run_dir / "logs"),
               "--checkpoint-dir", str(run_dir / "ckpt")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=150,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return result, run_dir


@pytest.mark.slow  # torchrun and its ranks as processes, tens of seconds
@pytest.mark.timeout(180)
def test_torchrun_entry_trains_and_writes_the_summary(torchrun_run):
    result, run_dir = torchrun_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Strategy: ddp (world size 2, dataset synthetic)") == 1
    assert "Final Accuracy:" in result.stdout
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["steps"]) == ("ddp", 2, STEPS)
    assert summary["samples_processed"] == 2 * 512 and summary["throughput_samples_per_s"] > 0
    # Without compression, no compression fields in the summary or the steps' records.
    assert "compression_ratio" not in summary and "compression_bytes_sent" not in summary
    for rank in (0, 1):
        records = read_metrics(run_dir / "logs" / f"rank{rank}" / "metrics.jsonl")
        assert [r["step"] for r in records if "loss/train" in r] == list(range(2, STEPS + 1, 2))
        assert not any(key.startswith("compression/") for record in records for key in record)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_rank_is_restarted_and_the_run_ends_bit_identical(cli, tmp_path, torchrun_run):
    reference, reference_dir = torchrun_run
    assert reference.returncode == 0, reference.stderr[-3000:]
    result = cli("ddp", "--world-size", 2, *TRAINING, "--max-restarts", 1,
                 "--inject", "kill:rank=1:step=7:attempt=0",
                 "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "injected fault: kill at step 7" in result.stderr
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert (summary["restarts"], summary["resumed_from_step"], summary["steps"]) == (1, 5, STEPS)

    expected, trained = final_model(reference_dir), final_model(tmp_path)
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
    # Work redone after the restart is logged once: the records of steps 6-7 were replaced.
    steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "rank1" / "metrics.jsonl")
             if "loss/train" in r]
    assert steps == list(range(2, STEPS + 1, 2))


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("args", "exit_code", "message"), [
    (["--world-size", 4, "--max-train-samples", 3],
     2, "world size 4 is larger than the 3 training samples"),
    (["--backend", "nccl"], 2, "nccl needs CUDA GPUs"),
    (["--world-size", 2, "--nnodes", 2, "--rdzv-endpoint", "192.0.2.1:29400", "--timeout-s", 2],
     1, "nothing answered at 192.0.2.1:29400 within 2s"),
], ids=["world-size-above-samples", "nccl-without-gpu", "unreachable-rendezvous"])
def test_bad_input_gives_one_line_and_no_hang(tmp_path, args, exit_code, message):
    if "nccl" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # `python -m disttrain.torchrun` outside an elastic agent is the launcher, as `disttrain ddp` is.
    result = subprocess.run(
        [sys.executable, "-m", "disttrain.torchrun", "--dataset", "digits", *map(str, args),
         "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == exit_code, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()
