"""SSP with its bound on steps (Ho et al.): the rules with no sockets and a hand-stepped clock.

A driver plays the workers: a worker computes on the version it last read, pushes, and
reads again only once the rules let it go on (`may_go_on`), as the shard holds its reply.
Hypothesis chooses who pushes next, so every interleaving the rules allow is tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.strategies.ps.server.aggregation import AggregationRules, Outcome, Push
from disttrain.strategies.ps.server.clocks import StepClocks


def rules(world_size: int, tau: int, mode: str = "ssp", **kwargs) -> AggregationRules:
    r = AggregationRules(mode, world_size, staleness_bound=tau, **kwargs)
    for rank in range(world_size):
        assert r.register(f"w{rank}") == rank
    return r


@dataclass
class Worker:
    rank: int
    steps: int  # its share of the epoch
    read: int = 0  # the version it computes on
    pushed: int = 0  # its clock
    held: bool = False  # pushed; its reply waits for the slowest
    done: bool = False


@dataclass
class Run:
    """Workers driven through the rules; `log` holds (rank, step, base version, decision)."""

    rules: AggregationRules
    workers: list[Worker]
    log: list[tuple[int, int, int, object]] = field(default_factory=list)

    @classmethod
    def of(cls, shares: list[int], tau: int, mode: str = "ssp", **kwargs) -> Run:
        return cls(rules(len(shares), tau, mode, **kwargs), [Worker(r, n) for r, n in enumerate(shares)])

    def ready(self) -> list[Worker]:
        return [w for w in self.workers if not w.held and not w.done]

    def push(self, worker: Worker, now: float = 0.0) -> None:
        worker.pushed += 1
        step, last = worker.pushed, worker.pushed == worker.steps
        push = Push(f"w{worker.rank}", step, worker.read, 1.0, block=100 * worker.rank + step,
                    last_in_epoch=last)
        decision = self.rules.offer(push, f"g{worker.rank}.{step}", now)
        self.log.append((worker.rank, step, worker.read, decision))
        worker.held = True
        self.release(now)

    def release(self, now: float = 0.0) -> None:
        """Every held worker the rules let go on reads the current version (or is done)."""
        for w in self.workers:
            if w.held and self.rules.may_go_on(w.rank, w.pushed, 0):
                w.held = False
                w.read = self.rules.version
                if w.pushed == w.steps:
                    w.done = True
                    self.rules.mark_done(f"w{w.rank}", now)
                    self.release(now)

    def spread(self) -> int:
        """The running workers' lead over the slowest worker that counts."""
        counted = [w.pushed for w in self.workers if not w.done and w.pushed < w.steps]
        running = [w.pushed for w in self.workers if not w.held and not w.done]
        return max(running) - min(counted) if running and counted else 0


@settings(max_examples=150, deadline=None)
@given(st.data(), st.lists(st.integers(1, 6), min_size=1, max_size=5), st.integers(0, 3))
def test_any_interleaving_keeps_the_bound_rejects_nothing_and_ends(data, shares, tau):
    """Whoever pushes next: no push is refused, no running worker is more than tau steps
    ahead of the slowest, every block is applied once, and the run never deadlocks."""
    run = Run.of(shares, tau)
    while any(not w.done for w in run.workers):
        ready = run.ready()
        assert ready, f"deadlock: every worker held at clocks {[w.pushed for w in run.workers]}"
        run.push(data.draw(st.sampled_from(ready)))
        assert run.spread() <= tau
        clocks = [w.pushed for w in run.workers if not w.done]
        assert not clocks or max(clocks) - min(clocks) <= tau + 1  # a held push counts already
    assert all(d.outcome is Outcome.APPLIED for *_, d in run.log)
    assert run.rules.counts["rejected_stale"] == 0 and run.rules.version == sum(shares)
    assert run.rules.ledger.blocks == {100 * r + s for r, n in enumerate(shares) for s in range(1, n + 1)}


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(1, 5))
def test_tau_zero_is_lockstep_as_sync(data, num_workers, steps):
    """tau = 0: every gradient of step s is computed on parameters holding every worker's
    steps before s, and the updates of one step all come before any of the next, the
    steps that sync applies, in the same groups."""
    run = Run.of([steps] * num_workers, tau=0)
    while run.ready():
        run.push(data.draw(st.sampled_from(run.ready())))
    assert all(w.done for w in run.workers)
    for _, step, base, _ in run.log:
        assert base >= num_workers * (step - 1)
    applied = [step for _, step, _, _ in run.log]
    assert applied == sorted(applied)
    ssp_groups = [sorted(r for r, s, _, _ in run.log if s == step) for step in range(1, steps + 1)]

    sync = rules(num_workers, 0, "sync")
    groups = []
    for step in range(1, steps + 1):
        for rank in data.draw(st.permutations(range(num_workers))):
            push = Push(f"w{rank}", step, sync.version, 1.0, block=100 * rank + step)
            decision = sync.offer(push, rank, 0.0)
            if decision.apply:
                groups.append([c.rank for c in decision.apply])
    assert groups == ssp_groups


@settings(max_examples=100, deadline=None)
@given(st.data(), st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_a_bound_beyond_the_run_is_async(data, shares):
    """tau beyond every worker's steps: nobody ever waits, and each decision is async's on
    the same interleaving (outcome, version, staleness, what is applied)."""
    ssp, asynchronous = Run.of(shares, tau=max(shares)), rules(len(shares), 0, "async")
    while ssp.ready():
        worker = data.draw(st.sampled_from(ssp.ready()))
        ssp.push(worker)
        rank, step, base, decision = ssp.log[-1]
        assert not worker.held or worker.done  # let go at once
        push = Push(f"w{rank}", step, base, 1.0, block=100 * rank + step)
        twin = asynchronous.offer(push, f"g{rank}.{step}", 0.0)
        assert (twin.outcome, twin.version, twin.staleness) == (decision.outcome, decision.version,
                                                                decision.staleness)
        assert [(c.rank, c.payload) for c in twin.apply] == [(c.rank, c.payload) for c in decision.apply]
    assert asynchronous.staleness_histogram == ssp.rules.staleness_histogram


def test_a_worker_tau_steps_ahead_waits_for_the_slowest_and_goes_on_when_it_catches_up():
    r = rules(3, tau=1)
    for step in (1, 2):
        assert r.offer(Push("w0", step, 0, 1.0, block=step), "g", 0.0).outcome is Outcome.APPLIED
    assert not r.may_go_on(0, 2, 0)  # two steps ahead of w1 and w2, at 0
    r.offer(Push("w1", 1, 0, 1.0, block=11), "g", 0.0)
    assert not r.may_go_on(0, 2, 0)  # w2 still at 0
    assert r.may_go_on(1, 1, 0) and r.may_go_on(2, 0, 0)  # the slowest are never held
    stale = r.offer(Push("w2", 1, 0, 1.0, block=21), "g", 0.0)
    assert stale.outcome is Outcome.APPLIED and stale.staleness == 3  # old parameters, still applied
    assert r.may_go_on(0, 2, 0) and r.counts["rejected_stale"] == 0


def test_finished_parked_and_failed_workers_hold_nobody():
    # done: out of the count
    r = rules(2, tau=0)
    r.offer(Push("w0", 1, 0, 1.0, block=1), "g", 0.0)
    assert not r.may_go_on(0, 1, 0)
    r.mark_done("w1", 0.0)
    assert r.may_go_on(0, 1, 0)
    # parked: its last block of the epoch pushed, it holds no step of that epoch, but one of the next
    r = rules(2, tau=0)
    r.offer(Push("w1", 1, 0, 1.0, block=11, last_in_epoch=True), "g", 0.0)
    r.offer(Push("w0", 1, 0, 1.0, block=1), "g", 0.0)
    r.offer(Push("w0", 2, 1, 1.0, block=2), "g", 0.0)
    assert r.may_go_on(0, 2, 0) and not r.may_go_on(0, 2, 1)
    # failed: the coordinator's membership drops it, as from a synchronous step
    r = rules(2, tau=0)
    r.set_membership(1, {"w0": 1, "w1": 1}, 0.0)
    r.offer(Push("w0", 1, 0, 1.0, block=1, generation=1), "g", 0.0)
    assert not r.may_go_on(0, 1, 0)
    r.set_membership(2, {"w0": 1}, 0.0)
    assert r.may_go_on(0, 1, 0)
    r.set_membership(3, {"w0": 1, "w1": 3}, 0.0)  # back: it holds again from its clock
    assert not r.may_go_on(0, 1, 0)


def test_duplicates_and_a_restarted_worker_change_no_clock_backwards():
    r = rules(2, tau=0)
    r.offer(Push("w0", 1, 0, 1.0, block=1), "g", 0.0)
    r.offer(Push("w1", 1, 0, 1.0, block=11), "g", 0.0)
    r.offer(Push("w1", 2, 2, 1.0, block=12), "g", 0.0)
    r.register("w1")  # restarted from its step-1 checkpoint: it pushes step 2 again
    again = r.offer(Push("w1", 2, 2, 1.0, block=12), "g", 0.0)
    assert again.outcome is Outcome.DUPLICATE and r.clocks.of(1) == 2 and r.version == 3
    assert r.may_go_on(1, 2, 0) is False  # w0 is at 1
    assert r.ledger.blocks == {1, 11, 12}


def test_clocks_are_saved_and_undone_with_the_rules():
    r = rules(2, tau=1)
    r.offer(Push("w0", 1, 0, 1.0, block=1), "g", 0.0)
    mark = r.mark()
    r.offer(Push("w0", 2, 1, 1.0, block=2), "g", 0.0)
    assert not r.may_go_on(0, 2, 0)
    r.rollback(mark)
    assert r.clocks.of(0) == 1 and r.may_go_on(0, 1, 0)
    restored = AggregationRules("ssp", 2, staleness_bound=1)
    restored.load_state_dict(r.state_dict())
    assert restored.clocks.of(0) == 1 and restored.clocks.of(1) == 0


def test_the_version_clock_keeps_the_rule_of_refusing_stale_gradients():
    r = rules(2, tau=1, ssp_clock="versions")
    r.offer(Push("w0", 1, 0, 1.0, block=1), "g", 0.0)
    r.offer(Push("w0", 2, 1, 1.0, block=2), "g", 0.0)
    stale = r.offer(Push("w1", 1, 0, 1.0, block=11), "g", 0.0)
    assert stale.outcome is Outcome.STALE and r.counts["rejected_stale"] == 1
    assert r.may_go_on(0, 50, 0)  # nobody waits: the bound is on versions


def test_an_unknown_clock_is_refused():
    with pytest.raises(ValueError, match="ssp clock 'rounds' is not one of steps, versions"):
        AggregationRules("ssp", 2, ssp_clock="rounds")


def test_the_slowest_clock_is_kept_without_a_pass_over_every_worker():
    clocks = StepClocks(4)
    everyone = lambda rank: True  # noqa: E731
    assert clocks.slowest(everyone) == 0
    for rank, step in [(0, 3), (1, 1), (2, 2), (3, 5)]:
        clocks.tick(rank, step)
    assert clocks.slowest(everyone) == 1 and clocks.slowest(everyone, excluded=[1]) == 2
    assert not clocks.tick(1, 1) and clocks.tick(1, 4)
    assert clocks.slowest(everyone) == 2
    clocks.changed()
    assert clocks.slowest(lambda rank: rank != 2) == 3
    clocks.changed()
    assert clocks.slowest(lambda rank: False) is None
