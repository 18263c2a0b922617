"""The shard-aware order of an epoch (`data.shard_order`) and the samplers that use it:
a permutation of every sample with each shard's samples consecutive, the same for the same
seed and epoch, exactly once over the ranks, and a resume (or a re-split) at any position
going on with exactly the rest."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.data import PlannedSampler, ShardedSampler
from disttrain.data.sampler import owed, resplit_state
from disttrain.data.shard_order import checked_sizes, shard_permutation, shard_starts

sizes_strategy = st.lists(st.integers(1, 12), min_size=1, max_size=12)


def shard_runs(order: torch.Tensor, sizes: list[int]) -> list[int]:
    """The shard of each sample of `order`, consecutive repeats folded."""
    shards = (torch.searchsorted(shard_starts(sizes), order, right=True) - 1).tolist()
    return [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_strategy, seed=st.integers(0, 10_000), epoch=st.integers(0, 50))
def test_the_order_is_a_permutation_read_shard_by_shard(sizes, seed, epoch):
    order = shard_permutation(sizes, seed, epoch)
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    runs = shard_runs(order, sizes)
    assert sorted(runs) == list(range(len(sizes)))  # each shard's samples in one run: every shard once
    assert torch.equal(order, shard_permutation(sizes, seed, epoch))


def test_shards_and_the_samples_in_them_are_shuffled_by_seed_and_epoch():
    sizes = [50] * 8
    orders = {(seed, epoch): shard_permutation(sizes, seed, epoch) for seed in (1, 2) for epoch in (0, 1)}
    assert len({tuple(o.tolist()) for o in orders.values()}) == 4
    first = orders[(1, 0)]
    assert shard_runs(first, sizes) != list(range(8))  # the shards are not in their own order
    within = first[:50] - int(first[0]) // 50 * 50
    assert within.tolist() != list(range(50))  # nor the samples within a shard


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_strategy, world_size=st.integers(1, 4), seed=st.integers(0, 1000),
       epoch=st.integers(0, 5), batch=st.integers(1, 7), data=st.data())
def test_every_sample_once_and_a_resume_at_any_position_is_the_rest(sizes, world_size, seed, epoch, batch,
                                                                     data):
    if sum(sizes) < world_size:
        return
    samplers = [ShardedSampler(sum(sizes), world_size=world_size, rank=r, seed=seed, shard_sizes=sizes)
                for r in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    shards = torch.cat([s.shard() for s in samplers])
    assert len(shards.unique()) == len(shards) == sum(sizes) // world_size * world_size
    assert torch.equal(shards, shard_permutation(sizes, seed, epoch)[:len(shards)])
    rank = data.draw(st.integers(0, world_size - 1))
    whole = list(samplers[rank].batches(batch))
    stop = data.draw(st.integers(0, len(whole)))
    cut = ShardedSampler(sum(sizes), world_size=world_size, rank=rank, seed=seed, shard_sizes=sizes)
    cut.set_epoch(epoch)
    taken = [b for _, b in zip(range(stop), cut.batches(batch), strict=False)]
    state = cut.state_dict()
    assert state["shard_sizes"] == sizes
    resumed = ShardedSampler(sum(sizes), world_size=world_size, rank=rank, seed=seed, shard_sizes=sizes)
    resumed.load_state_dict(state)
    rest = list(resumed.batches(batch))
    assert torch.equal(torch.cat(taken + rest) if taken + rest else torch.empty(0, dtype=torch.int64),
                       torch.cat(whole) if whole else torch.empty(0, dtype=torch.int64))


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=2, max_size=10), seed=st.integers(0, 100),
       written=st.integers(1, 3), wanted=st.integers(1, 3), data=st.data())
def test_a_re_split_epoch_keeps_the_shards_and_owes_exactly_the_rest(sizes, seed, written, wanted, data):
    if sum(sizes) < max(written, wanted) * 2:
        return
    layout = ShardedSampler(sum(sizes), world_size=written, seed=seed, shard_sizes=sizes)
    position = data.draw(st.integers(0, len(layout)))
    state = {**layout.state_dict(), "position": position}
    done = torch.cat([ShardedSampler(sum(sizes), world_size=written, rank=r, seed=seed,
                                     shard_sizes=sizes).shard()[:position] for r in range(written)])
    rest = owed(state)
    assert sorted(torch.cat([done, rest]).tolist()) == sorted(
        shard_permutation(sizes, seed, 0)[:len(layout) * written].tolist())
    new = [resplit_state(state, wanted, r) for r in range(wanted)]
    assert all(s["shard_sizes"] == sizes for s in new)
    samplers = []
    for r, s in enumerate(new):
        sampler = ShardedSampler(sum(sizes), world_size=wanted, rank=r, seed=seed, shard_sizes=sizes)
        sampler.load_state_dict(s)
        samplers.append(sampler)
    again = torch.cat([s.remaining() for s in samplers])
    if position == 0:  # at the epoch's start the new layout is the epoch's shard order, cut anew
        assert torch.equal(again, shard_permutation(sizes, seed, 0)[:sum(sizes) // wanted * wanted])
        return
    assert len(again.unique()) == len(again) and not set(again.tolist()) & set(done.tolist())
    assert set(again.tolist()) <= set(rest.tolist()) and len(rest) - len(again) < wanted
    for sampler in samplers:  # the next epoch is a shard order again
        sampler.set_epoch(1)
    assert torch.equal(torch.cat([s.shard() for s in samplers]),
                       shard_permutation(sizes, seed, 1)[:sum(sizes) // wanted * wanted])


def test_a_state_of_other_shards_or_none_is_refused():
    sizes = (10, 10, 5)
    by_shards = ShardedSampler(25, seed=1, shard_sizes=sizes)
    plain = ShardedSampler(25, seed=1)
    with pytest.raises(ValueError, match="sampler state orders no shards but this run reads 3 shards"):
        by_shards.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="orders 3 shards .* but this run reads no shards"):
        plain.load_state_dict(by_shards.state_dict())
    with pytest.raises(ValueError, match="resume with the same data"):
        ShardedSampler(25, seed=1, shard_sizes=(5, 10, 10)).load_state_dict(by_shards.state_dict())
    with pytest.raises(ValueError, match="not positive sizes summing to the data set's 25 samples"):
        checked_sizes((10, 10), 25)


def test_the_balanced_sampler_orders_by_shards_too():
    sizes = (7, 9, 8, 6)
    planned = PlannedSampler(30, world_size=2, rank=0, seed=3, shares=(3, 2))
    planned.read_by_shards(sizes)
    blocks = [planned.block(0, i, r) for i in range(planned.steps_per_epoch) for r in range(2)]
    assert torch.equal(torch.cat(blocks), shard_permutation(sizes, 3, 0)[:30])
    state = planned.state_dict()
    assert state["shard_sizes"] == list(sizes)
    with pytest.raises(ValueError, match="resume with the same data"):
        PlannedSampler(30, world_size=2, rank=0, seed=3, shares=(3, 2)).load_state_dict(state)
