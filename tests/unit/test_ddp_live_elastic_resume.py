"""A live rank taking a state written by a run of another size keeps that run's global
batch (and its first size, for `live_world_sizes`)."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import Config
from disttrain.strategies.ddp.live.trainer import LiveTrainer

SECTIONS = {"training": {"dataset": "digits", "model_architecture": "mlp", "batch_size": 16, "seed": 1,
                         "num_epochs": 2}}


def trainer(num_workers: int) -> LiveTrainer:
    torch.set_num_threads(1)
    return LiveTrainer(Config().replace(**SECTIONS, system={"num_workers": num_workers}), slot=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 3])
def test_a_state_of_two_ranks_keeps_its_global_batch_on_another_size(size):
    written = trainer(2)
    written.progress.index = 5
    taking = trainer(size)
    assert taking.global_batch == 16 * size
    taking.load_state_dict(written.state_dict())
    assert (taking.global_batch, taking.batches_per_epoch) == (32, written.batches_per_epoch)
    assert taking.ledger.shape == written.ledger.shape
    assert (taking.progress.index, taking.progress.first_world_size) == (5, 2)
    taking.attach(rank=0, world_size=size)
    assert len(taking.sampler.block(0, 5)) == [32, 11][size == 3]  # 32 over 3: 11, 11, 10

