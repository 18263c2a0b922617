"""A DDP epoch re-split over another number of ranks (`resplit_state`): whatever the sizes,
the position and a second resize within the same epoch, every sample of the epoch is
trained once, and only the tails that do not divide (each shorter than its world size)
are left out of it."""

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.data import ShardedSampler, epoch_permutation
from disttrain.data.sampler import resplit_state


def samplers_of(state: dict, world_size: int) -> list[ShardedSampler]:
    """Every rank of `world_size` resumed from `state` (rank 0's, as DDP saves it)."""
    ranks = []
    for rank in range(world_size):
        sampler = ShardedSampler(state["num_samples"], world_size=world_size, rank=rank, seed=state["seed"])
        sampler.load_state_dict(resplit_state(state, world_size, rank))
        ranks.append(sampler)
    return ranks


def train(ranks: list[ShardedSampler], batch_size: int, num_steps: int | None) -> list[int]:
    """`num_steps` lockstep steps of every rank (None: to the end of the epoch)."""
    trained = []
    iterators = [sampler.batches(batch_size) for sampler in ranks]
    step = 0
    while num_steps is None or step < num_steps:
        batches = [next(iterator, None) for iterator in iterators]
        if all(batch is None for batch in batches):
            break
        assert all(batch is not None for batch in batches), "ranks out of lockstep"
        trained += [int(i) for batch in batches for i in batch]
        step += 1
    return trained


def left_out(state: dict) -> set[int]:
    """The tail a re-split state leaves out of its epoch."""
    order = state["order"]
    return {int(i) for i in order[len(order) // state["world_size"] * state["world_size"]:]}


def out_after(resized: dict, out: set[int], permutation: torch.Tensor) -> set[int]:
    """What the epoch leaves out after a resize: a plain start (nothing trained yet) has
    only its own permutation's tail; a re-split adds its list's tail to the earlier ones."""
    if "order" not in resized:
        size = resized["world_size"]
        return {int(i) for i in permutation[len(permutation) // size * size:]}
    return out | left_out(resized)


@settings(max_examples=200, deadline=None)
@given(num_samples=st.integers(8, 200), sizes=st.lists(st.integers(1, 6), min_size=3, max_size=3),
       batch_size=st.integers(1, 9), steps=st.lists(st.integers(0, 30), min_size=2, max_size=2),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_an_epoch_resized_twice_trains_every_sample_once(num_samples, sizes, batch_size, steps, seed, epoch):
    first, second, third = sizes
    if num_samples < first:
        return
    ranks = [ShardedSampler(num_samples, world_size=first, rank=r, seed=seed) for r in range(first)]
    for sampler in ranks:
        sampler.set_epoch(epoch)
    trained = train(ranks, batch_size, steps[0])
    state = ranks[0].state_dict()
    permutation = epoch_permutation(num_samples, seed, epoch)
    expected_out = {int(i) for i in permutation[num_samples // first * first:]}  # the first tail
    expected_out = out_after(resplit_state(state, second, 0), expected_out, permutation)
    ranks = samplers_of(state, second)
    trained += train(ranks, batch_size, steps[1])
    state = torch.load(_round_trip(ranks[0].state_dict()), weights_only=True)  # as a checkpoint holds it
    expected_out = out_after(resplit_state(state, third, 0), expected_out, permutation)
    ranks = samplers_of(state, third)
    trained += train(ranks, batch_size, None)

    assert len(trained) == len(set(trained)), "a sample trained twice"
    assert set(trained) | expected_out == set(range(num_samples)), "a sample lost"
    assert not set(trained) & expected_out
    assert len(expected_out) <= (num_samples % first) + (second - 1) + (third - 1)
    for sampler in ranks:  # the next epoch is the plain split over the last size
        sampler.set_epoch(epoch + 1)
    fresh = ShardedSampler(num_samples, world_size=third, rank=third - 1, seed=seed)
    fresh.set_epoch(epoch + 1)
    assert torch.equal(ranks[-1].shard(), fresh.shard())


def _round_trip(state: dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_a_resize_at_an_epoch_start_is_the_plain_split():
    state = ShardedSampler(100, world_size=2, seed=4).state_dict()
    state["epoch"] = 3
    assert resplit_state(state, 3, 2) == {"num_samples": 100, "world_size": 3, "rank": 2, "seed": 4,
                                          "epoch": 3, "position": 0}


def test_a_resize_of_two_ranks_to_one_owes_the_rest_of_both_shards():
    ranks = [ShardedSampler(20, world_size=2, rank=r, seed=1) for r in range(2)]
    train(ranks, 3, 2)  # 6 of each shard of 10
    (alone,) = samplers_of(ranks[0].state_dict(), 1)
    assert torch.equal(alone.shard(), torch.cat([ranks[0].shard()[6:], ranks[1].shard()[6:]]))
    assert len(alone) == 8 and alone.position == 0


def test_a_state_with_a_bad_order_is_refused():
    sampler = ShardedSampler(10, seed=0)
    state = {**sampler.state_dict(), "order": torch.tensor([1, 1, 2])}
    with pytest.raises(ValueError, match="twice"):
        sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="outside"):
        sampler.load_state_dict({**state, "order": torch.tensor([3, 10])})


def test_a_balance_plan_is_not_resized():
    state = {**ShardedSampler(10, world_size=2, seed=0).state_dict(), "plans": {}}
    with pytest.raises(ValueError, match="--world-size 2"):
        resplit_state(state, 3, 0)
