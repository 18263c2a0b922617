"""The core check of the DDP path, with real rank processes on gloo: 2 ranks with plain
SGD end with the parameters of one process stepping on the concatenated batches, with
and without gradient accumulation; only the last micro-batch of a step communicates;
the test accuracy is counted over the whole test set exactly once. The accumulation case
runs as two nodes meeting at a c10d rendezvous, the multi-node path on one machine."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.data import ShardedSampler, load_datasets
from disttrain.metrics.logger import read_metrics
from disttrain.training.engine import build_optimizer, evaluate, forward_backward
from disttrain.training.loop import groups as accumulation_groups
from disttrain.training.models import build_model, count_parameters, init_model
from disttrain.training.stepping import OptimizerStep

SEED = 7
NUM_SAMPLES = 256
LEARNING_RATE = 0.05


# Warm-up then cosine decay, AdamW with weight decay on the weights, clipping by global
# norm: applied after the all-reduce, they still equal one process on the whole batch.
FEATURES = ("--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--warmup-steps", "2", "--lr-decay-steps", "4", "--lr-min", "0.005", "--clip-grad-norm", "0.2")
FEATURE_KEYS = {"optimizer": "adamw", "weight_decay": 0.1, "lr_schedule": "cosine", "warmup_steps": 2,
                "lr_decay_steps": 4, "lr_min": 0.005, "clip_grad_norm": 0.2}


def reference_model(training, world_size: int, micro_batch: int, accumulation: int):
    """One process, one model, each step on the concatenation of every rank's micro-batches."""
    train_set, _ = load_datasets(training)
    model = init_model(training)
    stepper = OptimizerStep(build_optimizer(model.parameters(), training), training)
    samplers = [ShardedSampler(len(train_set), world_size=world_size, rank=r, seed=training.seed)
                for r in range(world_size)]
    per_rank = [list(accumulation_groups(s.batches(micro_batch), accumulation)) for s in samplers]
    norms = []
    for groups in zip(*per_rank, strict=True):
        indices = torch.cat([torch.cat(group) for group in groups])
        stepper.optimizer.zero_grad()
        forward_backward(model, *train_set.batch(indices))
        stepper.step()
        norms.append(stepper.last_grad_norm or 0.0)
    assert not training.clip_grad_norm or max(norms) > training.clip_grad_norm  # clipping was tested
    return model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ddp(cli, tmp_path, accumulation: int, nodes: int, features: tuple[str, ...] = ()):
    """Train with `disttrain ddp`: one launcher for 2 ranks, or one launcher per "node" (1 rank
    each) meeting at a c10d rendezvous on a free local port."""
    micro_batch = 32 // accumulation
    args = ["ddp", "--world-size", 2, "--dataset", "synthetic", "--num-samples", NUM_SAMPLES,
            "--model", "mlp", "--set", "training.mlp_hidden_size=32",
            "--set", "training.mlp_num_layers=1", "--optimizer", "sgd",
            "--set", "training.momentum=0", "--learning-rate", LEARNING_RATE,
            "--batch-size", micro_batch, "--grad-accumulation-steps", accumulation, "--seed", SEED,
            "--set", "training.log_interval=1", "--log-dir", tmp_path / "logs",
            "--checkpoint-dir", tmp_path / "ckpt", *features]
    if nodes == 1:
        return [cli(*args, timeout=150)]
    args += ["--nnodes", nodes, "--rdzv-endpoint", f"localhost:{free_port()}", "--timeout-s", 60]
    with ThreadPoolExecutor(nodes) as pool:
        return list(pool.map(lambda _: cli(*args, timeout=150), range(nodes)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("accumulation", "nodes", "features"), [(1, 1, ()), (2, 2, ()), (2, 1, FEATURES)],
                         ids=["one-node", "accumulation-two-nodes", "warmup-adamw-clipping"])
def test_two_ranks_match_one_process_on_the_concatenated_batch(cli, tmp_path, accumulation, nodes, features):
    results = run_ddp(cli, tmp_path, accumulation, nodes, features)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert sum("Strategy: ddp (world size 2, dataset synthetic)" in r.stdout for r in results) == 1
    log_dir, checkpoint_dir = tmp_path / "logs", tmp_path / "ckpt"

    config = config_from_dict({"training": {
        "dataset": "synthetic", "num_samples": NUM_SAMPLES, "model_architecture": "mlp",
        "mlp_hidden_size": 32, "mlp_num_layers": 1, "seed": SEED, "learning_rate": LEARNING_RATE,
        "optimizer": "sgd", "momentum": 0.0, **(FEATURE_KEYS if features else {})}})
    expected = reference_model(config.training, 2, 32 // accumulation, accumulation)
    trained = torch.load(checkpoint_dir / "ddp_final.pt", weights_only=True)["model"]
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=name)

    # One all-reduce of every gradient per optimizer step, whatever the accumulation.
    steps = [r for r in read_metrics(log_dir / "rank1" / "metrics.jsonl") if "loss/train" in r]
    assert len(steps) == NUM_SAMPLES // 2 // 32
    gradient_bytes = 4 * count_parameters(expected)
    assert all(r["comm/bytes_allreduced"] == gradient_bytes for r in steps)
    # One bucket (the model is far below 25 MB): its all-reduce starts after the last gradient,
    # so all of it blocks the step and none overlaps the backward pass.
    assert all(0 < r["time/comm_blocked_s"] <= r["time/step_s"] for r in steps)
    assert all(r["time/comm_overlapped_s"] == 0 for r in steps)

    # The test accuracy summed over ranks is the final model's on the whole test set.
    module = build_model("mlp", (1, 28, 28), 10, config.training)
    module.load_state_dict(trained)
    _, test_set = load_datasets(config.training)
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["final_accuracy"] == evaluate(module, test_set).accuracy
    assert summary["samples_processed"] == NUM_SAMPLES and summary["world_size"] == 2
