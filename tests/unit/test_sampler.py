"""The sharded, resumable sampler: disjoint equal shards, per-epoch shuffles, exact resume."""

import pytest
import torch

from disttrain.data import ShardedSampler


def test_shards_are_disjoint_equal_and_cover_all_but_the_tail():
    samplers = [ShardedSampler(103, world_size=4, rank=r, seed=7) for r in range(4)]
    shards = [s.shard() for s in samplers]
    assert {len(s) for s in shards} == {25}
    union = torch.cat(shards)
    assert len(union.unique()) == 100


def test_each_epoch_reshuffles_deterministically():
    a, b = ShardedSampler(50, seed=1), ShardedSampler(50, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert torch.equal(a.shard(), b.shard())
    assert not torch.equal(a.shard(0), a.shard(1))
    assert not torch.equal(ShardedSampler(50, seed=2).shard(0), a.shard(0))


def test_batches_cover_the_shard_once_and_advance_the_position():
    sampler = ShardedSampler(23, seed=0)
    batches = list(sampler.batches(5))
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert torch.equal(torch.cat(batches), sampler.shard())
    assert sampler.position == 23 and len(sampler.remaining()) == 0
    assert sampler.num_batches(5) == 5 and sampler.num_batches(5, drop_last=True) == 4


def test_resume_mid_epoch_never_repeats_or_skips():
    first = ShardedSampler(40, world_size=2, rank=1, seed=3)
    first.set_epoch(2)
    iterator = first.batches(3)
    seen = [next(iterator) for _ in range(4)]
    state = first.state_dict()

    resumed = ShardedSampler(40, world_size=2, rank=1, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the loop sets the epoch again after a resume: the position stays
    assert torch.equal(torch.cat(seen), resumed.consumed())
    rest = list(resumed.batches(3))
    together = torch.cat(seen + rest)
    assert torch.equal(together, first.shard())


def test_new_epoch_starts_at_zero():
    sampler = ShardedSampler(10, seed=0)
    list(sampler.batches(4))
    sampler.set_epoch(1)
    assert sampler.position == 0 and len(list(sampler.batches(4))) == 3


def test_mismatched_state_is_refused():
    state = ShardedSampler(40, world_size=2, rank=0, seed=3).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        ShardedSampler(40, world_size=4, rank=0, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        ShardedSampler(41, world_size=2, rank=0, seed=3).load_state_dict(state)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="rank"):
        ShardedSampler(10, world_size=2, rank=2)
    with pytest.raises(ValueError, match="non-empty"):
        ShardedSampler(3, world_size=4, rank=0)
