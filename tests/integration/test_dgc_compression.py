"""Top-k with DGC's training rules (momentum correction and masking, local clipping,
sparsity warm-up) and compact payloads, end to end on both transports: a short run
trains (its loss falls, its accuracy clears a floor), and a run killed mid-way and
resumed ends with the very model of one never stopped, its velocities, residuals and
warm-up position restored from the checkpoint.

DDP: two ranks from the command line, killed at step 15 (checkpoint at 10). The parameter
server: one synchronous worker killed right after its checkpoint at step KILL_STEP (the
server then holds exactly that step's version), through shared memory where the machine
offers it, so a payload read as its upper bound of bytes is decoded too."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from disttrain.config import Config, config_from_dict
from disttrain.core.faults import parse_fault
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import Cluster
from disttrain.metrics.logger import read_metrics
from disttrain.strategies.ps.run.launcher import start_servers

DGC = {"type": "topk", "ratio": 0.02, "momentum_correction": 0.9, "local_clip_norm": 5.0,
       "warmup_steps": 6, "warmup_ratio": 0.25, "compact": True}
TIMEOUT_S = 120.0


def losses(log_dir: Path) -> list[float]:
    return [r["loss/train"] for r in read_metrics(log_dir / "metrics.jsonl") if "loss/train" in r]


def assert_trains(log_dir: Path, summary: dict) -> None:
    curve = losses(log_dir)
    assert len(curve) >= 6
    assert sum(curve[-3:]) / 3 < 0.8 * sum(curve[:3]) / 3, curve
    assert summary["final_accuracy"] >= 0.7, summary["final_accuracy"]
    assert summary["compression_ratio"] > 10


# -- DDP --------------------------------------------------------------------------------------

# 64 steps: dense SGD with momentum 0.9 reaches about 86% here, this run about as much.
DDP_ARGS = ["--world-size", 2, "--dataset", "digits", "--max-train-samples", 1024, "--max-test-samples", 200,
            "--num-epochs", 2, "--batch-size", 16, "--seed", 3, "--optimizer", "sgd", "--learning-rate", 0.1,
            "--checkpoint-interval", 10, "--compression-enabled",
            "--set", "training.log_interval=1", "--set", "training.momentum=0",
            *(item for key, value in DGC.items() for item in ("--set", f"compression.{key}={value}"))]


def ddp_dirs(run_dir: Path) -> list:
    return ["--log-dir", run_dir / "logs", "--checkpoint-dir", run_dir / "ckpt"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ddp_with_dgc_trains_and_resumes_bit_identical(cli, tmp_path):
    whole = cli("ddp", *DDP_ARGS, *ddp_dirs(tmp_path / "whole"), timeout=120)
    assert whole.returncode == 0, whole.stderr[-3000:]
    summary = json.loads((tmp_path / "whole" / "logs" / "summary.json").read_text())
    assert_trains(tmp_path / "whole" / "logs" / "rank0", summary)

    killed = cli("ddp", *DDP_ARGS, *ddp_dirs(tmp_path / "cut"), "--inject", "kill:rank=1:step=15",
                 timeout=120)
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert "injected fault: kill at step 15" in killed.stderr, killed.stderr[-3000:]
    resumed = cli("ddp", *DDP_ARGS, *ddp_dirs(tmp_path / "cut"), "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = torch.load(tmp_path / "whole" / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    trained = torch.load(tmp_path / "cut" / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
    checkpoint = torch.load(tmp_path / "cut" / "ckpt" / "checkpoint_step00000060.pt", weights_only=True)
    state = checkpoint["compression"][0]
    assert any(name.startswith("topk/velocity/") for name in state)
    steps = [int(value) for name, value in state.items() if name.startswith("topk/steps/")]
    assert steps and set(steps) == {60}


@pytest.mark.timeout(120)
@pytest.mark.slow  # a process start: seconds on a busy machine
def test_ddp_refuses_momentum_applied_twice(cli, tmp_path):
    result = cli("ddp", *DDP_ARGS, "--set", "training.momentum=0.9", *ddp_dirs(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "training.optimizer: sgd and training.momentum: 0" in result.stderr.strip().splitlines()[-1]


# -- parameter server -------------------------------------------------------------------------

KILL_STEP = 10


def ps_config(folder: Path) -> Config:
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd", "momentum": 0.0,
                     "learning_rate": 0.1, "batch_size": 16, "num_epochs": 2, "max_train_samples": 512,
                     "max_test_samples": 200, "checkpoint_interval": 5, "log_interval": 1},
        "system": {"num_workers": 1, "num_threads": 1, "checkpoint_dir": str(folder / "ckpt"),
                   "log_dir": str(folder / "logs")},
        "ps": {"aggregation_mode": "sync", "rpc_timeout_s": 30.0},
        "compression": {"enabled": True, **DGC},
    })


def wait_exit(cluster: Cluster, name: str) -> int:
    """`name`'s exit code once it exited (also when its exit event went by while the test
    waited for another child)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (code := cluster.children[name].process.poll()) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"{name} still running after {TIMEOUT_S:.0f}s:\n{cluster.children[name].tail(20)}")
        cluster.next_event(remaining)
    return code


def ps_final_model(config: Config) -> dict[str, torch.Tensor]:
    path = Path(config.system.checkpoint_dir) / "parameter_server_final.pt"
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ps_with_dgc_trains_and_a_resumed_worker_ends_bit_identical(cli, tmp_path):
    reference = ps_config(tmp_path / "reference")
    reference.save(tmp_path / "reference.yaml")
    result = cli("ps", "--config", tmp_path / "reference.yaml", timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "reference" / "logs" / "summary.json").read_text())
    assert_trains(tmp_path / "reference" / "logs" / "worker0", summary)

    config = ps_config(tmp_path / "resumed")
    config_path = tmp_path / "resumed.yaml"
    config.save(config_path)
    with Cluster(tmp_path / "cluster") as cluster:
        (address,) = start_servers(cluster, config_path, 1)
        worker = ProcessSpec("ps-worker", config=config_path, servers=(address,), rank=0, worker_id="worker0")
        cluster.spawn("worker0", replace(worker, faults=(parse_fault(f"kill:worker=0:step={KILL_STEP}"),)))
        assert wait_exit(cluster, "worker0") != 0
        cluster.spawn("worker0-resumed", replace(worker, resume=True))
        assert wait_exit(cluster, "worker0-resumed") == 0, cluster.children["worker0-resumed"].tail(20)
        assert wait_exit(cluster, "server0") == 0

    expected, trained = ps_final_model(reference), ps_final_model(config)
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
