"""DDP's buffer rule, with real rank processes on gloo: the strategy leaves PyTorch's
default (`broadcast_buffers=True`), so at every forward pass rank 0's buffers overwrite
the others' and each rank's pass then updates its own copy from its own batch. The
parameters follow the all-reduced gradients; the final model (rank 0's) holds the
buffers rank 0's passes left: 2 ranks end with the parameters of one process stepping on
both ranks' batches together, BatchNorm normalising each rank's part on its own, and
with the buffers of rank 0's parts alone. Local updates broadcast rank 0's buffers at each
round's end instead: at H = 1 (outer SGD at rate 1) the run ends the same."""

from __future__ import annotations

import pytest
import torch
from ps_reference import per_worker_reference

from disttrain.config import load_config
from disttrain.data import ShardedSampler, load_datasets
from disttrain.training.models import init_model

BATCH = 16


def rank_batches(config, train_set):
    samplers = [ShardedSampler(len(train_set), world_size=2, rank=r, seed=config.training.seed)
                for r in range(2)]
    yield from (list(batches) for batches in zip(*(s.batches(BATCH) for s in samplers), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(180)
# local updates at H = 1 with buffers: test_ddp_equivalence[local-updates-h1]; make test-extended runs it
@pytest.mark.parametrize("local", [(), pytest.param(("--local-updates", "--sync-every", 1),
                                                    marks=pytest.mark.extended)],
                         ids=["ddp", "local-updates-h1"])
def test_ddp_broadcasts_rank_zero_buffers_and_matches_one_process(cli, tmp_path, local):
    result = cli("ddp", *local, "--world-size", 2, "--dataset", "digits", "--model", "mlp_bn",
                 "--set", "training.mlp_hidden_size=32", "--set", "training.mlp_num_layers=2",
                 "--optimizer", "sgd", "--set", "training.momentum=0", "--learning-rate", "0.1",
                 "--batch-size", BATCH, "--max-train-samples", 96, "--max-test-samples", 60,
                 "--num-epochs", 1, "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt",
                 timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    config = load_config(tmp_path / "logs" / "config.yaml")
    train_set, _ = load_datasets(config.training)
    trained = torch.load(tmp_path / "ckpt" / "ddp_final.pt", weights_only=True)["model"]
    rank0 = per_worker_reference(config, train_set, rank_batches(config, train_set), "rank0")
    average = per_worker_reference(config, train_set, rank_batches(config, train_set), "average")
    initial = init_model(config.training).state_dict()
    assert any("running_mean" in name for name in trained)
    for name, want in rank0.items():
        torch.testing.assert_close(trained[name], want, rtol=0, atol=1e-5, msg=name)
    # the parameters are those of the average rule too (buffers do not reach the loss in
    # train mode); the running statistics are rank 0's, not the ranks' average
    for name in rank0:
        if "running" in name:
            assert not torch.allclose(trained[name], average[name], atol=1e-5), name
            assert not torch.allclose(trained[name], initial[name]), name
        elif "num_batches" not in name:
            torch.testing.assert_close(trained[name], average[name], rtol=0, atol=1e-5, msg=name)
    assert int(trained["net.2.num_batches_tracked"]) == 3
    assert ("Local updates:" in result.stdout) == bool(local)
