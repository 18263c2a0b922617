"""A compressed parameter-server run whose worker is killed and resumed ends with the very
model of an uninterrupted run: the worker's checkpoint carries its error-feedback
residuals and its stochastic-rounding generator, and picks up where they were.

Synchronous mode with one worker: the worker is killed right after writing its
checkpoint at step KILL_STEP, when the server holds exactly that step's version, so the
resumed worker computes the same gradients, compresses them the same way, and the server
applies the same updates, bit for bit."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import VARIANT

from disttrain.config import Config, config_from_dict
from disttrain.core.faults import parse_fault
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import Cluster
from disttrain.strategies.ps.run.launcher import start_servers

KILL_STEP = 10
TIMEOUT_S = 120.0


def make_config(folder: Path, compression: dict) -> Config:
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "adam",
                     "learning_rate": 0.01, "batch_size": 16, "num_epochs": 2, "max_train_samples": 256,
                     "max_test_samples": 100, "checkpoint_interval": 5, "log_interval": 4},
        "system": {"num_workers": 1, "num_threads": 1, "checkpoint_dir": str(folder / "ckpt"),
                   "log_dir": str(folder / "logs")},
        "ps": {"aggregation_mode": "sync", "rpc_timeout_s": 30.0},
        "compression": {"enabled": True, **compression},
    })


def wait_exit(cluster: Cluster, name: str) -> int:
    """`name`'s exit code once it exited (also when its exit event went by while the test
    waited for another child: the server may stop before the worker that stopped it)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (code := cluster.children[name].process.poll()) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"{name} still running after {TIMEOUT_S:.0f}s:\n{cluster.children[name].tail(20)}")
        cluster.next_event(remaining)  # wakes on any child's event, its exit among them
    return code


def final_model(config: Config) -> dict[str, torch.Tensor]:
    path = Path(config.system.checkpoint_dir) / "parameter_server_final.pt"
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compression", [
    {"type": "topk", "ratio": 0.05},
    pytest.param({"type": "quantization", "stochastic_rounding": True},
                 marks=VARIANT),
], ids=["topk-error-feedback", "quantization-stochastic"])
@pytest.mark.slow
def test_a_resumed_compressed_worker_ends_bit_identical(cli, tmp_path, compression):
    reference = make_config(tmp_path / "reference", compression)
    reference.save(tmp_path / "reference.yaml")
    result = cli("ps", "--config", tmp_path / "reference.yaml", timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]

    config = make_config(tmp_path / "resumed", compression)
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
        log = cluster.children["worker0-resumed"].tail(200)
    assert f"step {KILL_STEP}" in log or "resum" in log.lower(), log

    expected, trained = final_model(reference), final_model(config)
    assert expected.keys() == trained.keys()
    assert all(torch.equal(expected[name], trained[name]) for name in expected)
