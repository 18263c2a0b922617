"""Whole parameter-server runs from the CLI: real processes, real sockets.

The exactness check: 2 workers with plain SGD end with the parameters of one process
stepping on the concatenated batches, in the same order. Then the launcher's promises:
a process failing more often than it may be restarted stops the run, and killing the
launcher leaves no process behind.
"""

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from ps_reference import assert_matches_one_process, concatenated

from disttrain.config import load_config
from disttrain.core.checkpoint import load_checkpoint
from disttrain.data import ShardedSampler, load_datasets
from disttrain.metrics.logger import read_metrics
from disttrain.training.engine import forward_backward
from disttrain.training.evaluation import evaluate_model_file
from disttrain.training.models import init_model
from disttrain.training.schedule import LRSchedule

EXACT_ARGS = [
    "--dataset",
    "digits",
    "--model",
    "mlp",
    "--optimizer",
    "sgd",
    "--set",
    "training.momentum=0",
    "--learning-rate",
    "0.1",
    "--batch-size",
    "16",
    "--max-train-samples",
    "96",
    "--max-test-samples",
    "60",
    "--num-epochs",
    "1",
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, local", [("grpc", False), ("shared_memory", False),
                                              pytest.param("grpc", True, marks=pytest.mark.extended)])
def test_sync_two_workers_match_one_process_on_the_concatenated_batches(tmp_path, cli, transport, local):
    # Overlap is on (the default): each of the 2 shards' pushes leaves as soon as backward
    # produced its gradient, and the result is still the one process's. With local updates
    # at H = 1 (inner sgd, outer sgd at rate 1) each worker pushes its step's pseudo-gradient,
    # learning rate x gradient, and the shards' outer step applies their mean: the same.
    result = cli(
        "ps",
        "--workers",
        "2",
        "--servers",
        "2",
        *EXACT_ARGS,
        "--set",
        f"ps.payload_transport={transport}",
        *(["--local-updates"] if local else ["--set", "ps.overlap_trial_steps=0"]),  # overlap every step
        "--log-dir",
        tmp_path / "logs",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Strategy: ps-sync (world size 2" in result.stdout
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ps-sync" and summary["steps"] == 3 and summary["samples_processed"] == 96
    assert summary["shard_versions"] == [3, 3] and summary["staleness_histogram"] == {"0": 12}

    config = assert_matches_one_process(tmp_path, concatenated)
    assert (
        evaluate_model_file(tmp_path / "ckpt" / "parameter_server_final.pt", config.training).num_samples
        == 60
    )
    assert (tmp_path / "logs" / "worker1" / "metrics.jsonl").is_file()
    through_memory = "payloads go through shared memory" in (tmp_path / "logs" / "worker1.log").read_text()
    assert through_memory == (transport == "shared_memory")
    for rank in range(2):  # shard 1 (the last layer) went out while backward still computed
        records = read_metrics(tmp_path / "logs" / f"worker{rank}" / "metrics.jsonl")
        # (with local updates a push leaves once a round, after its last inner step)
        assert any(r.get("time/comm_overlapped_s", 0) > 0 for r in records) != local, records
    if local:
        assert (summary["sync_every"], summary["local_rounds"]) == (1, 3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix != ".sha256") == [
        "parameter_server_final.pt",
        "server0",
        "server1",
        "worker0",
        "worker1",
    ]


def local_reference(config, train_set, sync_every: int) -> dict[str, torch.Tensor]:
    """Two workers' local training, written out: each takes `sync_every` steps (the epoch's
    last ends a round) with its own SGD (its momentum kept across rounds) from the round's
    start; the shards average the pseudo-gradients and step nesterov on them."""
    training = config.training
    start = init_model(training)
    workers = [copy.deepcopy(start) for _ in range(2)]
    inner = [torch.optim.SGD(w.parameters(), lr=training.learning_rate, momentum=training.momentum)
             for w in workers]
    outer = torch.optim.SGD(start.parameters(), lr=training.outer_learning_rate,
                            momentum=training.outer_momentum, nesterov=True)
    samplers = [ShardedSampler(len(train_set), world_size=2, rank=r, seed=training.seed) for r in range(2)]
    for _ in range(training.num_epochs):
        steps = list(zip(*(s.batches(training.batch_size) for s in samplers), strict=True))
        for first in range(0, len(steps), sync_every):
            for worker, optimizer, rank in zip(workers, inner, range(2), strict=True):
                worker.load_state_dict(start.state_dict())
                for batches in steps[first:first + sync_every]:
                    inputs, targets = train_set.batch(batches[rank])
                    optimizer.zero_grad()
                    forward_backward(worker, inputs, targets)
                    optimizer.step()
            for param, *locals_ in zip(start.parameters(), *(w.parameters() for w in workers), strict=True):
                param.grad = sum(param.detach() - p.detach() for p in locals_) / 2
            outer.step()
    return start.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_updates_match_two_local_trainings_and_the_outer_step(tmp_path, cli):
    # 6 steps a worker, H = 4: rounds of 4 and 2 steps; inner momentum, outer nesterov on 2 shards.
    result = cli("ps", "--workers", "2", "--servers", "2", *EXACT_ARGS, "--set", "training.momentum=0.5",
                 "--batch-size", "8", "--sync-every", "4", "--outer-optimizer", "nesterov",
                 "--outer-lr", "0.7", "--outer-momentum", "0.9", "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert (summary["steps"], summary["local_rounds"], summary["shard_versions"]) == (6, 2, [2, 2])
    assert (summary["samples_applied"], summary["samples_lost"]) == (96, 0)
    config = load_config(tmp_path / "logs" / "config.yaml")
    train_set, _ = load_datasets(config.training)
    expected = local_reference(config, train_set, 4)
    final = load_checkpoint(tmp_path / "ckpt" / "parameter_server_final.pt")["model"]
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-5, msg=name)


# Warm-up then cosine decay, AdamW with weight decay on the weights only, clipping by
# global norm on the aggregated gradient. With one server its norm is the global one; with
# two, each clips its share (`ps.server.optimizer`), so exactness is held with clipping off.
FEATURES = ["--optimizer", "adamw", "--weight-decay", "0.1", "--learning-rate", "0.01",
            "--lr-schedule", "cosine", "--warmup-steps", "2", "--lr-decay-steps", "6", "--lr-min", "0.001"]
# gpt_small made tiny (1 layer of width 16, 2 heads, 8 tokens) on synthetic byte-level
# text: the loss is over every token of every window. Dropout off, as in the reference.
# Biases off: the attention's key bias adds one constant to a query's scores, which the
# softmax ignores, so its gradient is zero in exact arithmetic and only rounding noise in
# floats; AdamW scales that noise up to steps of about the learning rate, and the noise of
# two summation orders (two workers' halves, one process's whole) differs.
TINY_TRANSFORMER = ["--model", "gpt_small", "--dataset", "synthetic:text", "--seq-len", "8",
                    "--num-samples", "192", "--set",
                    "training.model_args={n_layer: 1, n_head: 2, n_embd: 16, dropout: 0.0, bias: false}"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers, clip, loader, model",
                         [(1, "0.3", "1", TINY_TRANSFORMER), (2, "0", "0", [])],
                         ids=["transformer-one-server-clipped-loader-workers", "two-servers"])
@pytest.mark.slow
def test_sync_with_warmup_adamw_and_clipping_matches_one_process(tmp_path, cli, servers, clip, loader, model):
    result = cli("ps", "--workers", "2", "--servers", str(servers), *EXACT_ARGS, *FEATURES, *model,
                 "--loader-workers", loader, "--set", "training.log_interval=1",
                 "--max-train-samples", "192",
                 "--clip-grad-norm", clip, "--log-dir", tmp_path / "logs", "--checkpoint-dir",
                 tmp_path / "ckpt", timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    config = assert_matches_one_process(tmp_path, concatenated)
    assert config.training.optimizer == "adamw" and config.training.clip_grad_norm == float(clip)
    assert config.training.model_architecture == ("gpt_small" if model else "mlp")
    # The shards' schedule went 6 steps along the curve, as their checkpoints keep it, and
    # each worker logged the rate its gradient was applied with, as the shards told it.
    for shard in range(servers):
        newest = max((tmp_path / "ckpt" / f"server{shard}").glob("*.pt"))
        assert load_checkpoint(newest)["schedule"] == {"num_steps": 6}
    schedule = LRSchedule.of(config.training)
    rates = [config.training.learning_rate * schedule.factor(step) for step in range(6)]
    for rank in range(2):
        records = read_metrics(tmp_path / "logs" / f"worker{rank}" / "metrics.jsonl")
        assert [r["optim/learning_rate"] for r in records if "loss/train" in r] == pytest.approx(rates)


@pytest.mark.slow  # a cluster as processes, tens of seconds
@pytest.mark.timeout(120)
def test_a_worker_failing_past_its_restarts_stops_the_whole_cluster(tmp_path, cli):
    result = cli(
        "ps",
        "--workers",
        "2",
        "--dataset",
        "digits",
        "--num-epochs",
        "20",
        "--log-dir",
        tmp_path / "logs",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--inject",
        "kill:worker=1:step=3",
        "--max-restarts",
        "0",
        "--set",
        "coordinator.reassign_after=null",  # without reassignment, the run cannot go on without it
        timeout=110,
    )
    assert result.returncode == 1
    assert "worker1 killed by SIGKILL, and restarts are off (coordinator.max_restarts=0)" in result.stderr
    assert cluster_processes(tmp_path) == []


def cluster_processes(marker) -> list[int]:
    """Pids of live processes whose command line mentions `marker` (this test's folder)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(marker).encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.extended)])
def test_stopping_the_launcher_leaves_no_process_behind(tmp_path, signum):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disttrain",
            "ps",
            "--workers",
            "2",
            "--servers",
            "2",
            "--dataset",
            "digits",
            "--num-epochs",
            "500",
            "--log-dir",
            str(tmp_path / "logs"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        metrics = [tmp_path / "logs" / f"worker{r}" / "metrics.jsonl" for r in range(2)]
        wait_until(
            lambda: all(m.is_file() and m.stat().st_size for m in metrics), 90, "both workers training"
        )
        assert len(cluster_processes(tmp_path)) >= 5  # launcher, 2 servers, 2 workers
        launcher.send_signal(signum)
        launcher.wait(timeout=30)
        wait_until(lambda: cluster_processes(tmp_path) == [], 20, "every cluster process to exit")
        if signum == signal.SIGINT:
            assert launcher.returncode == 130
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pull_compression_receives_fewer_bytes_and_ends_on_the_servers_parameters(tmp_path, cli):
    # gRPC bytes: through shared memory the answers stay dense (no socket to save).
    result = cli("ps", "--workers", "2", "--servers", "2", *EXACT_ARGS, "--max-train-samples", "160",
                 "--set", "ps.payload_transport=grpc", "--pull-compression", "topk",
                 "--pull-ratio", "0.05", "--dense-pull-every", "3",
                 "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["shard_versions"] == [5, 5]
    # 6 answers a worker: the first pull, steps 1-5 (3 dense), and the final pull on worker 0
    assert summary["compression_pull_ratio"] > 1.5
    assert summary["compression_bytes_received"] == summary["bytes_received"]
    assert summary["bytes_received"] == sum(w["bytes_received"] for w in summary["workers"])
    assert "compression_ratio" not in summary and summary["bytes_sent"] > 0  # pushes dense
    final = load_checkpoint(tmp_path / "ckpt" / "parameter_server_final.pt")["model"]
    servers = [load_checkpoint(max((tmp_path / "ckpt" / f"server{s}").glob("*.pt"), key=os.path.getmtime))
               for s in range(2)]
    flat = torch.cat([s["params"] for s in servers])
    assert torch.equal(torch.cat([v.reshape(-1) for v in final.values()]), flat)
