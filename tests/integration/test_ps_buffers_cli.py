"""A model with buffers (BatchNorm) under the parameter server, from the CLI: real
processes, real sockets.

The buffer rule (README, "Buffers"): the servers hold the buffers; each push carries the
change the worker's step made to them and the servers move them by the weighted sum of
the changes they apply (sync: the sample-weighted mean of the workers' buffers). So a
synchronous run of 2 workers ends with the parameters and buffers of one process that
steps on both workers' batches together, BatchNorm normalising each worker's part on its
own, as the workers do.
"""

import json

import pytest
import torch
from conftest import VARIANT
from ps_reference import per_worker_reference

from disttrain.config import load_config
from disttrain.core.checkpoint import latest_checkpoint, load_checkpoint
from disttrain.data import ShardedSampler, load_datasets
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.training.evaluation import evaluate_model_file
from disttrain.training.models import init_model

BATCH = 16
ARGS = ["--dataset", "digits", "--model", "mlp_bn", "--optimizer", "sgd", "--set", "training.momentum=0",
        "--set", "training.mlp_hidden_size=32", "--set", "training.mlp_num_layers=2",
        "--learning-rate", "0.1", "--batch-size", str(BATCH), "--max-train-samples", "96",
        "--max-test-samples", "60", "--num-epochs", "1", "--workers", "2", "--servers", "2"]


def worker_batches(config, train_set):
    """Each step's batches of the 2 workers, in rank order."""
    samplers = [ShardedSampler(len(train_set), world_size=2, rank=r, seed=config.training.seed)
                for r in range(2)]
    yield from (list(batches) for batches in zip(*(s.batches(BATCH) for s in samplers), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(120)
# Local updates at H = 1 (the local path forced; inner sgd, outer sgd at rate 1): each
# push is a round's pseudo-gradient and the buffers' change over the round, the shards
# average both by samples, and the result is the per-step one's.
@pytest.mark.parametrize("local", [[], pytest.param(["--local-updates"], marks=pytest.mark.extended)],
                         ids=["per-step", "local-h1"])
def test_sync_with_batch_norm_matches_one_process_and_keeps_the_buffer_rule(tmp_path, cli, local):
    result = cli("ps", *ARGS, *local, "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt",
                 timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ps-sync" and summary["steps"] == 3

    config = load_config(tmp_path / "logs" / "config.yaml")
    train_set, _ = load_datasets(config.training)
    expected = per_worker_reference(config, train_set, worker_batches(config, train_set), "average")
    final = load_checkpoint(tmp_path / "ckpt" / "parameter_server_final.pt")["model"]
    initial = init_model(config.training).state_dict()
    assert set(final) == set(expected) and any("running_mean" in name for name in final)
    for name, want in expected.items():
        torch.testing.assert_close(final[name], want, rtol=0, atol=1e-5, msg=name)
        if "running" in name:  # the buffers moved: the rule was applied, not skipped
            assert not torch.allclose(final[name], initial[name]), name
    assert int(final["net.2.num_batches_tracked"]) == 3  # one per synchronous step
    # the servers' newest checkpoints hold the same buffers (a restarted server resumes them)
    held = {}
    for shard in range(2):
        state = load_checkpoint(latest_checkpoint(tmp_path / "ckpt" / f"server{shard}"))
        assert state["version"] == 3
        held[shard] = state["buffers"]
    assert sum(b.numel() for b in held.values()) == sum(
        t.numel() for name, t in final.items() if "running" in name or "num_batches" in name)
    # the workers evaluated the servers' model, buffers included (eval mode reads them)
    evaluation = evaluate_model_file(tmp_path / "ckpt" / "parameter_server_final.pt", config.training)
    assert summary["final_loss"] == pytest.approx(evaluation.loss, abs=1e-6)
    assert summary["final_accuracy"] == evaluation.accuracy
    # the launcher showed the shard plan at start: each shard's tensors, bytes and buffers
    assert "shard plan: 2 shard(s)" in result.stderr
    for shard in range(2):
        assert f"shard {shard}/2: " in result.stderr and "3 buffer(s)" in result.stderr


@pytest.mark.slow  # a parameter-server cluster as processes, tens of seconds
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=VARIANT)])
def test_async_and_ssp_add_each_applied_push_change(tmp_path, cli, mode):
    result = cli("ps", *ARGS, "--aggregation-mode", mode, "--staleness", "1", "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    config = load_config(tmp_path / "logs" / "config.yaml")
    final = load_checkpoint(tmp_path / "ckpt" / "parameter_server_final.pt")["model"]
    initial = init_model(config.training).state_dict()
    # each applied push added its batch to the counter: 96 samples in batches of 16, once each
    assert summary["samples_applied"] == 96
    assert [int(final[f"net.{i}.num_batches_tracked"]) for i in (2, 5)] == [6, 6]
    for name, value in final.items():
        assert torch.isfinite(value.double()).all(), name
        if "running" in name:
            assert not torch.allclose(value, initial[name]), name
    evaluation = evaluate_model_file(tmp_path / "ckpt" / "parameter_server_final.pt", config.training)
    assert summary["final_loss"] == pytest.approx(evaluation.loss, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(240)
# A server's restore: test_ps_fault_tolerance; a restarted shard's buffers:
# tests/distributed/test_ps_buffers; the buffer rule end to end: the sync test above
@pytest.mark.extended
def test_a_killed_server_comes_back_with_its_buffers(tmp_path, cli):
    args = ["--dataset", "digits", "--model", "mlp_bn", "--set", "training.mlp_hidden_size=32",
            "--set", "training.mlp_num_layers=2", "--workers", "2", "--batch-size", "32",
            "--max-train-samples", "640", "--max-test-samples", "100", "--num-epochs", "1",
            "--checkpoint-interval", "3", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
            "--inject", "kill:server=0:step=7"]
    result = cli("ps", *args, "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt",
                 timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert [f["process"] for f in summary["failures"]] == ["server0"] and summary["samples_lost"] == 0
    log = (tmp_path / "logs" / "server0.log").read_text()
    assert "restored version" in log
    config = load_config(tmp_path / "logs" / "config.yaml")
    (plan,) = plan_shards(init_model(config.training), 1)
    final = load_checkpoint(tmp_path / "ckpt" / "parameter_server_final.pt")["model"]
    held = load_checkpoint(latest_checkpoint(tmp_path / "ckpt" / "server0"))["buffers"]
    # the final model's buffers are the restarted server's, which went on from its checkpoint:
    # its counter counts every step since the start, not since the restart
    torch.testing.assert_close(torch.cat([final[b.name].double().reshape(-1) for b in plan.buffers]), held,
                               rtol=0, atol=1e-6)
    assert int(final["net.2.num_batches_tracked"]) == summary["shard_versions"][0] >= 10
