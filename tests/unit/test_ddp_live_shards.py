"""A live rank on a data set read by shards (`shards:DIR`) orders each epoch shard by
shard, as the training loop does (`data.shard_order`): every generation's split of a
global batch is cut from that order, and the reader is told the shards of the member's
pieces to come, so a step reads none itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.config import Config
from disttrain.data.datasets import digits
from disttrain.data.shard_order import shard_permutation
from disttrain.data.shards import write_shards
from disttrain.strategies.ddp.live.trainer import LiveTrainer
from tests.live_steps import live_evaluate, live_step

SHARD, BATCH, SEED = 64, 16, 5  # digits' 1,437 training samples in 23 shards


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    train, test = digits()
    return str(write_shards(tmp_path_factory.mktemp("shards") / "digits", (train.images.numpy(),
                            train.labels.numpy()), (test.images.numpy(), test.labels.numpy()), SHARD))


def trainer(spec: str, num_workers: int, tmp_path) -> LiveTrainer:
    torch.set_num_threads(1)
    config = Config().replace(
        training={"dataset": spec, "model_architecture": "mlp", "batch_size": BATCH, "seed": SEED,
                  "num_epochs": 2, "data_dir": str(tmp_path / "data"), "num_shards_in_memory": 3,
                  "num_shards_ahead": 2},
        system={"num_workers": num_workers})
    return LiveTrainer(config, slot=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_split_of_the_global_batches_is_cut_from_the_shard_order(spec, tmp_path, world_size):
    live = trainer(spec, 2, tmp_path)
    assert live.shards is not None
    sizes = live.shards.shard_sizes
    assert len(sizes) == 23
    for epoch in (0, 1):
        order = shard_permutation(sizes, SEED, epoch)
        live.attach(rank=0, world_size=world_size)
        for index in range(live.batches_per_epoch):
            pieces = [live.sampler.block(epoch, index, rank) for rank in range(world_size)]
            assert torch.equal(torch.cat(pieces), order[index * 32:(index + 1) * 32])
    assert not torch.equal(shard_permutation(sizes, SEED, 0), shard_permutation(sizes, SEED, 1))


@pytest.mark.timeout(120)
def test_a_live_rank_reads_its_shards_ahead_and_its_steps_read_none(spec, tmp_path):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        live = trainer(spec, 1, tmp_path)
        live.attach(rank=0, world_size=1)
        reader = live.train_set.reader
        first = reader.stats
        while not live.epoch_done:
            live_step(live)
        assert first is reader.stats  # no plan since the attach's
        assert first.read_on_demand == 0
        # shard by shard: each shard the epoch's global batches touch is read once
        taken = shard_permutation(live.shards.shard_sizes, SEED, 0)[:live.batches_per_epoch * BATCH]
        assert first.read_ahead == len(set(live.train_set.shards_of(taken).tolist()))
        live_evaluate(live)  # the next epoch's plan: the reader counts afresh
        assert reader.stats is not first
    finally:
        dist.destroy_process_group()
