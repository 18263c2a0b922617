"""The balance plan: batches in proportion to speed, summing to the global batch; a
warm-up's speed slowed as the `slow` fault slows steps; re-planning when speeds drift."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disttrain.config import SystemConfig
from disttrain.coordinator.reports import BalanceState
from disttrain.core.faults import FaultInjector, parse_fault
from disttrain.data import PlannedSampler
from disttrain.training.balance import measure_speed, plan_batches
from disttrain.training.rebalance import Rebalancer, drifted


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


def test_a_slow_fault_slows_the_warm_up_as_it_slows_steps():
    now = [0.0]

    def one_pass() -> int:  # 10 ms of work on a fake clock
        now[0] += 0.01
        return 64

    assert measure_speed(one_pass, clock=lambda: now[0]) == pytest.approx(64 / 0.01)
    slow = FaultInjector([parse_fault("slow:worker=0:factor=3")], "worker", 0)
    assert measure_speed(one_pass, slow, clock=lambda: now[0]) == pytest.approx(64 / 0.03)


def test_a_re_plan_waits_for_a_drift_larger_than_the_noise():
    assert not drifted((64, 64), (66, 62), (100.0, 95.0))  # 1.04x: noise
    assert drifted((64, 64), (96, 32), (300.0, 100.0))  # a 3x straggler: 1.5x shorter steps
    assert drifted((96, 32), (64, 64), (100.0, 100.0))  # the straggler recovered
    assert not drifted((96, 32), (96, 32), (300.0, 100.0))


class FakeRun:
    """Two processes' rebalancers on one fake clock: each sample takes 1 ms of work, `slow`
    times that on rank 1; both leave each step together (the faster one waited)."""

    def __init__(self, interval: int = 4):
        self.now, self.slow = 0.0, 1.0
        self.samplers = [PlannedSampler(2000, world_size=2, rank=r, seed=1, shares=(32, 32)) for r in (0, 1)]
        self.reported: list[list[float]] = [[], []]
        system = SystemConfig(balance="auto", balance_margin=0.2, balance_interval=interval)
        self.rebalancers = [Rebalancer(s, system, self.gather_for(r), warmup_speed=900.0 + r,
                                       clock=lambda: self.now) for r, s in enumerate(self.samplers)]

    def gather_for(self, rank: int):
        def gather(name: str, speed: float, step: int) -> list[float]:
            self.reported[rank].append(speed)  # what this process measured, then everyone's
            return [1000.0, 1000.0 / self.slow]
        return gather

    def step(self, step: int) -> None:
        sizes = [len(next(iter(s.batches()))) for s in self.samplers]
        work = [sizes[0] * 1e-3, sizes[1] * 1e-3 * self.slow]
        self.now += max(work)
        for rank, rebalancer in enumerate(self.rebalancers):
            rebalancer.after_step(step, 0, sizes[rank], max(work) - work[rank])


def test_a_straggler_mid_run_is_re_planned_around_and_no_sample_is_lost_or_repeated():
    run = FakeRun()
    before = run.rebalancers[1].balance
    assert before == BalanceState(batch_size=32, warmup_speed=901.0, plans=1)
    for rebalancer in run.rebalancers:
        rebalancer.restart()
    seen, sizes = [], []
    for step in range(1, 21):
        if step == 6:
            run.slow = 3.0  # rank 1 becomes a straggler from step 6
        sizes.append([s.batch_size() for s in run.samplers])
        seen += [s.block(0, s.index) for s in run.samplers]
        run.step(step)
    assert sizes[:8] == [[32, 32]] * 8 and sizes[8:] == [[48, 16]] * 12  # re-planned after step 8
    assert run.samplers[0].plans == run.samplers[1].plans == [(0, 0, (32, 32)), (0, 8, (48, 16))]
    assert run.reported[0][0] == pytest.approx(1000.0) and run.reported[1][0] == pytest.approx(1000.0)
    assert run.reported[1][-1] == pytest.approx(1000.0 / 3)  # its own work, not the others' waits
    # its balance state, a new value (a heartbeat thread holding the old one sees it whole)
    assert run.rebalancers[1].balance == BalanceState(batch_size=16, warmup_speed=901.0, plans=2)
    assert before == BalanceState(32, 901.0, 1)
    whole = PlannedSampler(2000, world_size=1, rank=0, seed=1, shares=(64,))
    assert torch.equal(torch.cat(seen), torch.cat([whole.block(0, i) for i in range(20)]))


def test_a_planned_sampler_resumes_with_its_plans_and_refuses_a_plain_state():
    sampler = PlannedSampler(640, world_size=2, rank=0, seed=1, shares=(32, 32))
    for _ in range(3):
        next(iter(sampler.batches()))
    assert sampler.replan((40, 24)) and not sampler.replan((40, 24))
    state = sampler.state_dict()
    other = PlannedSampler(640, world_size=2, rank=1, seed=1, shares=(10, 54))  # the state's plans win
    other.load_state_dict(state)
    assert other.index == 3 and other.shares == (40, 24) and other.shares_at(0, 2) == (32, 32)
    assert torch.equal(other.block(0, 3), sampler.block(0, 3, rank=1))
    with pytest.raises(ValueError, match="no balance plan"):
        other.load_state_dict({k: v for k, v in state.items() if k != "plans"})
    for _ in sampler.batches():
        pass
    sampler.replan((32, 32))  # at an epoch's end: from the next epoch's first batch
    assert sampler.plans[-1] == (1, 0, (32, 32)) and sampler.shares_at(0, 9) == (40, 24)


def test_a_new_generations_first_step_is_not_measured():
    """A live member's checks start unmeasured (`LiveBalance.start`): its first step (a
    joiner's first forward, its caches) may take many times its later ones, and a speed
    over it would hand a rejoined rank a straggler's piece."""
    run = FakeRun()
    run.now += 1.0  # the first step's cold start: a second before its 32 ms of work
    run.step(1)
    for step in range(2, 5):
        run.step(step)
    assert run.reported[0] == [pytest.approx(1000.0)]  # steps 2 to 4, at 1 ms a sample
