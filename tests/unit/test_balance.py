"""The balance plan: batches in proportion to speed, summing to the global batch; the
sampler's proportional shards; a warm-up's speed slowed as the `slow` fault slows steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disttrain.core.faults import FaultInjector, parse_fault
from disttrain.data import ShardedSampler
from disttrain.training.balance import measure_speed, plan_batches


def test_proportional_batches_follow_speed_and_keep_the_global_batch():
    assert plan_batches([300.0, 100.0], 128, "proportional", 0.2) == [96, 32]
    assert plan_batches([1.0, 1.0, 1.0], 64, "proportional", 0.2) == [22, 21, 21]


def test_none_and_auto_within_the_margin_keep_equal_batches():
    assert plan_batches([300.0, 100.0], 128, "none", 0.2) == [64, 64]
    assert plan_batches([100.0, 85.0], 128, "auto", 0.2) == [64, 64]
    assert plan_batches([100.0, 70.0], 128, "auto", 0.2) == [75, 53]


@given(st.lists(st.floats(min_value=0.01, max_value=1e6), min_size=1, max_size=8),
       st.integers(min_value=8, max_value=4096))
def test_every_plan_sums_to_the_global_batch_with_a_sample_each(speeds, global_batch):
    batches = plan_batches(speeds, global_batch, "proportional", 0.2)
    assert sum(batches) == global_batch and min(batches) >= 1 and len(batches) == len(speeds)


def test_a_plan_refuses_what_cannot_be_split():
    with pytest.raises(ValueError):
        plan_batches([1.0, 0.0], 64, "proportional", 0.2)
    with pytest.raises(ValueError):
        plan_batches([1.0, 1.0], 1, "proportional", 0.2)


def test_proportional_shards_are_disjoint_and_take_equal_steps():
    samplers = [ShardedSampler(100, world_size=2, rank=r, seed=3, shares=(24, 8)) for r in (0, 1)]
    batches = [list(s.batches(16)) for s in samplers]
    assert [len(b) for b in batches] == [3, 3]  # 100 // 32 global batches each epoch
    assert all(len(b) == 24 for b in batches[0]) and all(len(b) == 8 for b in batches[1])
    seen = torch.cat([torch.cat(b) for b in batches])
    assert len(set(seen.tolist())) == 96


def test_a_rank_resumes_from_another_ranks_state_in_batches_of_its_own():
    rank0 = ShardedSampler(100, world_size=2, rank=0, seed=3, shares=(24, 8))
    next(rank0.batches(16))
    rank1 = ShardedSampler(100, world_size=2, rank=1, seed=3)  # planned otherwise: the state's plan wins
    rank1.load_state_dict(rank0.state_dict())
    assert rank1.shares == (24, 8) and rank1.position == 8
    plain = ShardedSampler(100, world_size=2, rank=1, seed=3, shares=(24, 8))
    with pytest.raises(ValueError, match="no balance plan"):
        plain.load_state_dict(ShardedSampler(100, world_size=2, rank=0, seed=3).state_dict())


def test_a_slow_fault_slows_the_warm_up_as_it_slows_steps():
    now = [0.0]

    def one_pass() -> int:  # 10 ms of work on a fake clock
        now[0] += 0.01
        return 64

    assert measure_speed(one_pass, clock=lambda: now[0]) == pytest.approx(64 / 0.01)
    slow = FaultInjector([parse_fault("slow:worker=0:factor=3")], "worker", 0)
    assert measure_speed(one_pass, slow, clock=lambda: now[0]) == pytest.approx(64 / 0.03)
