"""The core check of the DDP path, with real rank processes on gloo: 2 ranks with plain
SGD end with the parameters of one process stepping on the concatenated batches, with
and without gradient accumulation, and so does a transformer with warm-up, AdamW and
clipping, and so do local updates at H = 1 (outer SGD at rate 1: sync by another path);
only the last micro-batch of a step communicates; the test figures are counted over the
whole test set exactly once. The accumulation case runs as two nodes meeting at a c10d
rendezvous, the multi-node path on one machine. Local updates at H = 4 end with the
parameters of two independent trainings, one per rank's batches, whose pseudo-gradients
are averaged and applied by Nesterov momentum every 4 steps and at the epoch's end."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from disttrain.config import load_config
from disttrain.core.addresses import unclaimed_port
from disttrain.data import ShardedSampler, load_datasets
from disttrain.metrics.logger import read_metrics
from disttrain.training.engine import build_optimizer, evaluate, forward_backward
from disttrain.training.loop import groups as accumulation_groups
from disttrain.training.models import count_parameters, init_model
from disttrain.training.stepping import OptimizerStep

SEED = 7
NUM_SAMPLES = 256
LEARNING_RATE = 0.05


# Warm-up then cosine decay, AdamW with weight decay on the weights, clipping by global
# norm: applied after the all-reduce, they still equal one process on the whole batch. On
# gpt_small made tiny (1 layer of width 16, 2 heads, 8 tokens) over synthetic byte-level
# text, its loss over every token; see test_ps_cluster's TINY_TRANSFORMER for its args.
FEATURES = ("--optimizer", "adamw", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--warmup-steps", "2", "--lr-decay-steps", "4", "--lr-min", "0.005", "--clip-grad-norm", "0.2",
            "--model", "gpt_small", "--dataset", "synthetic:text", "--seq-len", "8",
            "--set", "training.model_args={n_layer: 1, n_head: 2, n_embd: 16, dropout: 0.0, bias: false}")


# The local-update path at H = 1: each rank steps alone, then the outer SGD at rate 1
# makes every rank's parameters the mean of theirs, which an inner SGD without momentum
# makes one step on the averaged gradient.
LOCAL_H1 = ("--sync-every", "1", "--local-updates", "--outer-optimizer", "sgd", "--outer-lr", "1")


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
    args += ["--nnodes", nodes, "--rdzv-endpoint", f"localhost:{unclaimed_port()}", "--timeout-s", 60]
    with ThreadPoolExecutor(nodes) as pool:
        return list(pool.map(lambda _: cli(*args, timeout=150), range(nodes)))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("accumulation", "nodes", "features"),
                         [(1, 1, ()), (2, 2, ()), (2, 1, FEATURES), (1, 1, LOCAL_H1)],
                         ids=["one-node", "accumulation-two-nodes", "transformer-warmup-adamw-clipping",
                              "local-updates-h1"])
def test_two_ranks_match_one_process_on_the_concatenated_batch(cli, tmp_path, accumulation, nodes, features):
    results = run_ddp(cli, tmp_path, accumulation, nodes, features)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    dataset = "synthetic:text" if features == FEATURES else "synthetic"
    assert sum(f"Strategy: ddp (world size 2, dataset {dataset})" in r.stdout for r in results) == 1
    log_dir, checkpoint_dir = tmp_path / "logs", tmp_path / "ckpt"

    config = load_config(log_dir / "config.yaml")  # the run's, as its ranks resolved it
    training = config.training
    assert (training.num_samples, training.seed, training.momentum) == (NUM_SAMPLES, SEED, 0.0)
    if features == FEATURES:
        assert (training.model_architecture, training.optimizer, training.clip_grad_norm) == \
            ("gpt_small", "adamw", 0.2)
    else:
        assert (training.model_architecture, training.optimizer, training.learning_rate) == \
            ("mlp", "sgd", LEARNING_RATE)
    expected = reference_model(training, 2, 32 // accumulation, accumulation)
    trained = torch.load(checkpoint_dir / "ddp_final.pt", weights_only=True)["model"]
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5 if features == FEATURES else 1e-6,
                                   msg=name)

    # One all-reduce of every gradient per optimizer step, whatever the accumulation.
    steps = [r for r in read_metrics(log_dir / "rank1" / "metrics.jsonl") if "loss/train" in r]
    assert len(steps) == NUM_SAMPLES // 2 // 32
    gradient_bytes = 4 * count_parameters(expected)
    assert all(r["comm/bytes_allreduced"] == gradient_bytes for r in steps)
    # One bucket (the model is far below 25 MB): its all-reduce starts after the last gradient,
    # so all of it blocks the step and none overlaps the backward pass.
    assert all(0 < r["time/comm_blocked_s"] <= r["time/step_s"] for r in steps)
    assert all(r["time/comm_overlapped_s"] == 0 for r in steps)

    # The test figures summed over ranks are the final model's on the whole test set.
    module = init_model(config.training)
    module.load_state_dict(trained)
    _, test_set = load_datasets(config.training)
    summary = json.loads((log_dir / "summary.json").read_text())
    whole = evaluate(module, test_set)
    assert summary["final_accuracy"] == whole.accuracy  # a language model's: of next tokens
    if features == FEATURES:
        assert summary["final_perplexity"] == pytest.approx(whole.perplexity, rel=1e-6)
    assert summary["samples_processed"] == NUM_SAMPLES and summary["world_size"] == 2
    if features == LOCAL_H1:  # the other path indeed ran: one round per step
        assert summary["local_rounds"] == len(steps) and all(r["local/rounds"] == 1 for r in steps)
    else:
        assert "local_rounds" not in summary


SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM, INNER_MOMENTUM = 4, 0.7, 0.9, 0.5
LOCAL_BATCH = 12  # 128 samples per rank: 11 steps, the last of 8 samples; rounds of 4, 4 and 3


def local_reference(training, world_size: int):
    """Each rank's model trained alone on its batches (its own SGD with momentum); every
    `SYNC_EVERY` steps and at the epoch's end the mean of (start - model) over the ranks
    is applied to the start by Nesterov momentum, and every model continues from there."""
    train_set, _ = load_datasets(training)
    start_model = init_model(training)
    models = [copy.deepcopy(start_model) for _ in range(world_size)]
    steppers = [OptimizerStep(build_optimizer(m.parameters(), training), training) for m in models]
    samplers = [ShardedSampler(len(train_set), world_size=world_size, rank=r, seed=training.seed)
                for r in range(world_size)]
    per_rank = [list(s.batches(LOCAL_BATCH)) for s in samplers]
    start = [p.detach().clone() for p in start_model.parameters()]
    momentum = [torch.zeros_like(p) for p in start]
    num_steps = len(per_rank[0])
    for i in range(num_steps):
        for model, stepper, batches in zip(models, steppers, per_rank, strict=True):
            stepper.optimizer.zero_grad()
            forward_backward(model, *train_set.batch(batches[i]))
            stepper.step()
        if (i + 1) % SYNC_EVERY and i + 1 < num_steps:
            continue
        with torch.no_grad():
            for j, params in enumerate(zip(*(m.parameters() for m in models), strict=True)):
                delta = start[j] - sum(p.detach() for p in params) / world_size
                momentum[j] = OUTER_MOMENTUM * momentum[j] + delta
                start[j] = start[j] - OUTER_LR * (delta + OUTER_MOMENTUM * momentum[j])
                for param in params:
                    param.copy_(start[j])
    return models[0], num_steps


@pytest.mark.slow  # a run of two ranks as processes, tens of seconds
@pytest.mark.timeout(180)
def test_local_updates_match_independent_trainings_and_their_outer_steps(cli, tmp_path):
    local = ("--sync-every", SYNC_EVERY, "--outer-optimizer", "nesterov", "--outer-lr", OUTER_LR,
             "--outer-momentum", OUTER_MOMENTUM, "--batch-size", LOCAL_BATCH,
             "--set", f"training.momentum={INNER_MOMENTUM}")
    result, = run_ddp(cli, tmp_path, 1, 1, local)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("Local updates: sync every 4 steps, outer nesterov (lr 0.7, momentum 0.9), 3 rounds"
            in result.stdout)
    log_dir = tmp_path / "logs"
    training = load_config(log_dir / "config.yaml").training
    assert (training.momentum, training.batch_size) == (INNER_MOMENTUM, LOCAL_BATCH)
    expected, num_steps = local_reference(training, 2)
    trained = torch.load(tmp_path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=name)

    # Communication at a round's end only: the pseudo-gradient, as many bytes as the model.
    steps = [r for r in read_metrics(log_dir / "rank1" / "metrics.jsonl") if "loss/train" in r]
    assert [r["step"] for r in steps] == list(range(1, num_steps + 1))
    model_bytes = 4 * count_parameters(expected)
    ends = [4, 8, 11]
    assert [r["comm/bytes_allreduced"] for r in steps] == \
        [model_bytes if r["step"] in ends else 0 for r in steps]
    assert [r["step"] for r in steps if r["local/rounds"]] == ends
    assert all(r["time/comm_blocked_s"] == 0 for r in steps if r["step"] not in ends)
    summary = json.loads((log_dir / "summary.json").read_text())
    assert (summary["local_rounds"], summary["sync_every"], summary["outer_optimizer"]) == (3, 4, "nesterov")
