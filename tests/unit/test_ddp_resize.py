"""A DDP checkpoint of N ranks as rank r of M loads it (`strategies.ddp.resize`): the
epoch re-split, the RNG re-derived from the seed, the residuals dropped, the run's samples
counted once, the global batch kept; the runs that cannot be resized are refused."""

import pytest
import torch

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError
from disttrain.data import ShardedSampler
from disttrain.strategies.ddp import resize
from disttrain.training.seeding import seed_training


def checkpoint(world_size: int = 2, batch_size: int = 6, samples: int = 30, **extra) -> dict:
    sampler = ShardedSampler(100, world_size=world_size, seed=4)
    sampler.position = samples
    return {"strategy": "ddp", "world_size": world_size, "rng": [ckpt.rng_state()] * world_size,
            "compression": [{"residual": torch.ones(3)}] * world_size, "sampler": sampler.state_dict(),
            "position": {"epoch": 0, "step": 5, "samples_processed": samples, "train_time_s": 1.0},
            "config": {"training": {"batch_size": batch_size}}, **extra}


def test_a_rank_of_another_size_gets_the_re_split_a_derived_rng_and_no_residuals():
    states = [resize.resize_state(checkpoint(), 3, rank, seed=4, batch_size=4) for rank in range(3)]
    seed_training(4, 5 * 3 + 2)  # step 5, rank 2 of 3
    assert torch.equal(states[2]["rng"]["torch"], torch.get_rng_state())
    assert not torch.equal(states[0]["rng"]["torch"], states[2]["rng"]["torch"])
    assert all("compression" not in state and state["compression_dropped"] and state["resized_from"] == 2
               for state in states)
    assert [state["sampler"]["rank"] for state in states] == [0, 1, 2]
    assert len(states[0]["sampler"]["order"]) == 2 * (50 - 30)
    assert sum(state["position"]["samples_processed"] for state in states) == 60
    assert [state["samples_extra"] for state in states] == [0, 0, 0]


def test_the_samples_count_survives_two_resizes():
    first = resize.resize_state(checkpoint(samples=31), 4, 0, seed=4, batch_size=3)  # 62 over 4
    assert (first["position"]["samples_processed"], first["samples_extra"]) == (15 + 2, 2)
    again = {**first, "world_size": 4, "rng": [first["rng"]] * 4,
             "config": {"training": {"batch_size": 3}}}
    ones = [resize.resize_state(again, 3, rank, seed=4, batch_size=4) for rank in range(3)]
    assert sum(state["position"]["samples_processed"] for state in ones) == 62


def test_a_batch_that_does_not_keep_the_global_batch_is_refused():
    with pytest.raises(ConfigError, match="resume with --batch-size 4"):
        resize.resize_state(checkpoint(), 3, 0, seed=4, batch_size=6)
    with pytest.raises(ConfigError, match=r"^system.num_workers: the checkpoint's global batch of 12 "
                                          r"\(2 ranks x 6\) does not divide over 5 ranks; resume with "
                                          r"--world-size in 1, 2, 3, 4, 6, 12 \(each keeps it\)$"):
        resize.resized_batch_size(6, 2, 5)


def test_local_updates_and_balance_plans_are_not_resized():
    with pytest.raises(ConfigError, match="local updates .* resume with --world-size 2"):
        resize.resize_state(checkpoint(local=[{}, {}]), 3, 0, seed=4, batch_size=4)
    state = checkpoint()
    state["sampler"]["plans"] = {}
    with pytest.raises(ConfigError, match="balance plan .* resume with --world-size 2"):
        resize.resize_state(state, 3, 0, seed=4, batch_size=4)


def test_the_launcher_gives_the_ranks_the_batch_that_keeps_the_global_batch(tmp_path, caplog):
    ckpt.save_checkpoint(tmp_path, 5, checkpoint())
    config = Config().replace(system={"checkpoint_dir": str(tmp_path), "num_workers": 1},
                              training={"batch_size": 6})
    with caplog.at_level("INFO"):
        assert resize.resumed_config(config).training.batch_size == 12
    assert ("resuming a checkpoint of 2 ranks on 1: per-rank batch 12 keeps the global batch of 12"
            in caplog.text)
    same = config.replace(system={"num_workers": 2})
    assert resize.resumed_config(same) is same
