"""A balanced live member times its work on its training clock: an evaluation, a checkpoint
write and the faults meant for them stop that clock, so none of them makes the member
look slow to the next split of the global batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.config import Config
from disttrain.strategies.ddp.live.trainer import LiveTrainer
from tests.live_steps import live_step


@pytest.mark.timeout(60)
def test_a_balanced_member_times_its_work_on_its_training_clock(tmp_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = Config().replace(
            training={"dataset": "digits", "model_architecture": "mlp", "batch_size": 16, "num_epochs": 1,
                      "data_dir": str(tmp_path / "data")},
            system={"num_workers": 1, "balance": "proportional", "balance_interval": 1000})
        live = LiveTrainer(config, slot=0)
        live.attach(rank=0, world_size=1)
        live_step(live)
        clock = live.balance.rebalancer.clock
        with live.clock.paused():  # as during an evaluation or a checkpoint write
            before = clock()
            live_step(live)  # work the clock does not see
            assert clock() == before
        assert clock() > before
    finally:
        dist.destroy_process_group()
