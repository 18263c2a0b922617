"""`disttrain ps` in async and SSP mode with pull compression (topk) on digits, beside
the same run pulling dense: it trains as well (the final accuracy within a few points of
the dense run's) and the workers receive several times fewer bytes, as the summary
reports them (`bytes_received`, `compression_pull_ratio`); the final model is the
shards' parameters themselves."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import run_cli

from disttrain.core.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ARGS = ["--workers", "2", "--servers", "2", "--dataset", "digits", "--model", "mlp", "--optimizer", "sgd",
        "--set", "training.momentum=0", "--learning-rate", "0.1", "--batch-size", "16", "--num-epochs", "2",
        # gRPC bytes: through shared memory the answers stay dense (no socket to save)
        "--set", "ps.payload_transport=grpc"]


def train(folder, mode: str, *extra: str) -> dict:
    result = run_cli("ps", *ARGS, "--aggregation-mode", mode, "--staleness", "2", *extra,
                     "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.extended)])
def test_pull_compression_trains_like_dense_on_fewer_bytes(tmp_path, mode):
    with ThreadPoolExecutor(2) as pool:
        dense_run = pool.submit(train, tmp_path / "dense", mode)
        pulled_run = pool.submit(train, tmp_path / "topk", mode, "--pull-compression", "topk",
                                 "--pull-ratio", "0.05")
        dense, pulled = dense_run.result(), pulled_run.result()
    assert dense["final_accuracy"] > 0.85, dense["final_accuracy"]
    assert pulled["final_accuracy"] > dense["final_accuracy"] - 0.06, (pulled["final_accuracy"],
                                                                        dense["final_accuracy"])
    assert "compression_pull_ratio" not in dense
    assert pulled["bytes_received"] * 3 < dense["bytes_received"]
    assert pulled["compression_pull_ratio"] > 3
    assert pulled["bytes_received"] == sum(w["bytes_received"] for w in pulled["workers"])
    ckpt = tmp_path / "topk" / "ckpt"
    final = load_checkpoint(ckpt / "parameter_server_final.pt")["model"]
    servers = [load_checkpoint(max((ckpt / f"server{s}").glob("*.pt"), key=os.path.getmtime))
               for s in range(2)]
    # the run's end resets the broadcast copy: the final model is the parameters, not the copy
    assert torch.equal(torch.cat([v.reshape(-1) for v in final.values()]),
                       torch.cat([s["params"] for s in servers]))
