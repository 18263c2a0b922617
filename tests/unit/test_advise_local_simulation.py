"""`advise --simulate` replays local updates step by step (`advise.local_simulation`):
with constant step times its mean step is the cost model's `streaming_step_s`, Streaming
DiLoCo's fragments cut the largest exchange to 1/F of the bytes, a delay hides what its
inner steps cover, a straggler holds up every exchange, and a failed worker costs the
exchange its restart and the steps it lost since its last exchange."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.advise import (
    Candidate,
    CostModel,
    Link,
    RoundTrip,
    SimulationSetup,
    StepTimes,
    Workload,
    simulate,
    simulate_local_updates,
)
from disttrain.cli import advise as command

MB = 1e6


def cost_model(bandwidth: float = 1e8) -> CostModel:
    workload = Workload("test", 10_000_000, int(40 * MB), 10, 32, 0.1, 0.2, 0.01, 0.0, "given")
    return CostModel(workload, Link(bandwidth, 1e-3))


def replay(model: CostModel, c: Candidate, n: int, steps: int, times: StepTimes | None = None):
    w = model.workload
    setup = SimulationSetup("local", n, steps, batch_size=w.batch_size, sync_every=c.sync_every,
                            fragments=c.fragments, delay=c.delay)
    return simulate_local_updates(setup, times or StepTimes(w.compute_s + w.optimizer_s),
                                  *model.fragment_exchange(c, n))


@pytest.mark.parametrize("candidate, bandwidth", [
    (Candidate("ddp", sync_every=8), 1e8),
    (Candidate("ddp", sync_every=8, fragments=4), 1e8),
    (Candidate("ddp", sync_every=8, fragments=4, delay=1), 1e8),  # partly hidden
    (Candidate("ddp", sync_every=8, fragments=2, delay=4), 1e9),  # hidden
    (Candidate("ddp", sync_every=8, fragments=8, delay=4), 1e7),  # bound by the link
    (Candidate("ps-sync", "none", 4, 8, fragments=2, delay=2), 1e8),
])
def test_the_replayed_mean_step_is_the_cost_models(candidate, bandwidth):
    model, n, steps = cost_model(bandwidth), 4, 8 * 100
    predicted = model.predict(candidate, n)
    result = replay(model, candidate, n, steps)
    assert result.num_updates == steps and result.num_exchanges == 100 * candidate.fragments
    # an epoch's last exchanges, still in flight, are left out of both
    assert result.time_per_update_s == pytest.approx(predicted.step_time_s, rel=0.01)
    assert result.samples_per_s == pytest.approx(predicted.samples_per_s, rel=0.01)
    assert result.peak_bytes == pytest.approx(predicted.details["peak_bytes"], rel=1e-9)


@pytest.mark.parametrize("strategy, num_servers", [("ddp", 0), ("ps-sync", 4)])
def test_fragments_carry_a_share_of_the_bytes_each_and_the_same_in_all(strategy, num_servers):
    model, n, steps = cost_model(), 4, 8 * 10
    whole = replay(model, Candidate(strategy, "none", num_servers, 8), n, steps)
    fragmented = replay(model, Candidate(strategy, "none", num_servers, 8, fragments=4), n, steps)
    assert fragmented.peak_bytes == pytest.approx(whole.peak_bytes / 4, rel=1e-9)
    assert fragmented.num_exchanges == 4 * whole.num_exchanges == 4 * 10
    assert fragmented.exchange_bytes == pytest.approx(whole.exchange_bytes, rel=1e-9)


@pytest.mark.parametrize("exchange_s, blocked_s", [(0.0, 0.0), (1.5, 0.0), (2.0, 0.0), (3.5, 1.5)])
def test_a_delay_blocks_only_what_its_inner_steps_do_not_hide(exchange_s, blocked_s):
    """1 s inner steps, H = 8 in 2 fragments (an exchange every 4 steps), tau = 2."""
    setup = SimulationSetup("local", 4, 8 * 50, sync_every=8, fragments=2, delay=2)
    result = simulate_local_updates(setup, StepTimes(1.0), exchange_s, 1000.0)
    assert result.blocked_s == pytest.approx(blocked_s, abs=1e-9)
    assert result.time_per_update_s == pytest.approx(1.0 + blocked_s / 4, rel=0.01)
    undelayed = simulate_local_updates(SimulationSetup("local", 4, 8 * 50, sync_every=8, fragments=2),
                                       StepTimes(1.0), exchange_s, 1000.0)
    assert undelayed.blocked_s == pytest.approx(exchange_s, abs=1e-9)


def test_a_straggler_holds_up_every_exchange():
    """One worker of 4 computes 3x slower: the others wait for it at every exchange, so
    the run steps at its pace; with no exchange at all it would not hold them."""
    setup = SimulationSetup("local", 4, 8 * 50, sync_every=8)
    times = StepTimes(1.0, straggler_fraction=0.25)
    result = simulate_local_updates(setup, times, 0.5, 1000.0)
    assert result.time_per_update_s == pytest.approx(3.0 + 0.5 / 8, rel=1e-9)
    assert result.blocked_s == pytest.approx((3 * 8 * 2.0 + 0.5 * 4) / 4, rel=1e-9)  # per worker


@pytest.mark.parametrize("fragments, delay", [(1, 0), (2, 0), (4, 2)])
def test_an_epochs_last_step_exchanges_every_fragment_and_waits_for_all(fragments, delay):
    """1 s inner steps, H = 8, an epoch of 10 steps a worker, 0.5 s a fragment's exchange:
    the last step (10) lands what is in flight, then sends every fragment, one after
    another, and the epoch ends once all are back; the steady state (no epoch) has no
    such step."""
    exchange_s, steps = 0.5, 10
    setup = SimulationSetup("local", 4, 1000, sync_every=8, fragments=fragments, delay=delay,
                            steps_per_worker=steps)
    result = simulate_local_updates(setup, StepTimes(1.0), exchange_s, 1000.0)
    within = [s for s in range(1, steps) if s % 8 in {f * 8 // fragments % 8 for f in range(fragments)}]
    assert result.num_exchanges == len(within) + fragments
    assert result.exchange_bytes == pytest.approx(1000.0 * (len(within) + fragments))
    assert result.peak_bytes == 1000.0  # one fragment an exchange, the last step's too
    # the epoch's compute, what the exchanges within it blocked, then the F exchanges of its end
    undelayed_blocking = exchange_s * len(within) if delay == 0 else 0.0
    assert result.virtual_time_s == pytest.approx(steps * 1.0 + undelayed_blocking + fragments * exchange_s)
    steady = simulate_local_updates(SimulationSetup("local", 4, steps, sync_every=8, fragments=fragments,
                                                    delay=delay), StepTimes(1.0), exchange_s, 1000.0)
    at_ten = sum(1 for f in range(fragments) if steps % 8 == f * 8 // fragments % 8)
    assert steady.num_exchanges == len(within) + at_ten


def test_local_setups_and_their_replay_are_refused_where_they_do_not_apply():
    trip = RoundTrip(0.0, 0.0, 0.01, 0.0, 0.0, 0.01)
    with pytest.raises(ValueError, match="mode local"):
        SimulationSetup("sync", 4, sync_every=8)
    with pytest.raises(ValueError, match="5 fragments need 1 to H = 4"):
        SimulationSetup("local", 4, sync_every=4, fragments=5)
    with pytest.raises(ValueError, match="delay 4 must be in"):
        SimulationSetup("local", 4, sync_every=4, delay=4)
    with pytest.raises(ValueError, match="simulate_local_updates"):
        simulate(SimulationSetup("local", 4, sync_every=4), StepTimes(1.0), trip)
    with pytest.raises(ValueError, match="not 'sync'"):
        simulate_local_updates(SimulationSetup("sync", 4), StepTimes(1.0), 1.0, 1.0)
    with pytest.raises(ValueError, match="no local updates"):
        cost_model().fragment_exchange(Candidate("ddp"), 4)


def _first_seed(setup: SimulationSetup, times: StepTimes, exchange_s: float, num_failures: int):
    """The lowest seed whose run has `num_failures` failures, and that run."""
    for seed in range(1000):
        result = simulate_local_updates(replace(setup, seed=seed), times, exchange_s, 1000.0)
        if result.num_failures == num_failures:
            return result
    raise AssertionError(f"no seed below 1000 gives {num_failures} failures")


def test_without_failures_nothing_is_lost_or_drawn():
    setup = SimulationSetup("local", 4, 8 * 20, sync_every=8, fragments=2, delay=1, seed=3)
    times = StepTimes(1.0, lognormal_sigma=0.3, straggler_fraction=0.25)
    result = simulate_local_updates(setup, times, 0.5, 1000.0)
    assert result.num_failures == 0 and result.num_steps_lost == 0 and result.work_dropped_fraction == 0
    # the restart's parameters matter only where a worker fails
    again = simulate_local_updates(setup, replace(times, detect_s=1.0, restart_s=99.0), 0.5, 1000.0)
    assert again.virtual_time_s == result.virtual_time_s


@pytest.mark.parametrize("fragments, delay", [(1, 0), (4, 0), (4, 2)])
def test_a_single_worker_pays_its_restart_and_the_steps_it_lost_for_each_failure(fragments, delay):
    """1 s inner steps, H = 8, one worker, 0.5 s exchanges (none hidden without a delay):
    every failure adds the restart (its detection inside it) and the steps it lost, the
    failed one included, to the run, and nothing else."""
    times = StepTimes(1.0, failure_rate=0.05, detect_s=2.0, restart_s=7.0)
    setup = SimulationSetup("local", 1, 8 * 20, sync_every=8, fragments=fragments, delay=delay)
    clean = simulate_local_updates(setup, replace(times, failure_rate=0.0), 0.5, 1000.0)
    for seed in range(5):
        result = simulate_local_updates(replace(setup, seed=seed), times, 0.5, 1000.0)
        assert result.num_failures > 0
        # a failure loses at most the steps between two exchanges (H/F), the failed one included
        assert result.num_failures <= result.num_steps_lost <= result.num_failures * 8 // fragments
        cost = result.num_failures * 7.0 + result.num_steps_lost * 1.0
        if delay == 0:
            assert result.virtual_time_s == pytest.approx(clean.virtual_time_s + cost, rel=1e-12)
        else:  # a late worker may find its delayed exchange already back
            assert clean.virtual_time_s + cost - 20 * fragments * 0.5 <= result.virtual_time_s
            assert result.virtual_time_s <= clean.virtual_time_s + cost + 1e-9
        assert result.work_dropped_fraction == pytest.approx(
            result.num_steps_lost / (8 * 20 + result.num_steps_lost), rel=1e-12)


def test_the_exchange_waits_for_the_restarted_worker():
    """4 workers at 1 s a step, H = 8, 0.5 s an exchange, one failure: the failed worker
    is back 7 s later and redoes what it lost; the others wait for it at the exchange,
    so the run takes that much longer and their waits hold it."""
    times = StepTimes(1.0, failure_rate=0.01, detect_s=2.0, restart_s=7.0)
    setup = SimulationSetup("local", 4, 8 * 10, sync_every=8)
    clean = simulate_local_updates(setup, replace(times, failure_rate=0.0), 0.5, 1000.0)
    result = _first_seed(setup, times, 0.5, 1)
    lost = result.num_steps_lost
    assert 1 <= lost <= 8
    assert result.virtual_time_s == pytest.approx(clean.virtual_time_s + 7.0 + lost, rel=1e-12)
    assert result.time_per_update_s == pytest.approx((clean.virtual_time_s + 7.0 + lost) / 80, rel=1e-12)
    # every exchange lands (the last step, 80, is a sync step); the 3 others waited for it
    waited = result.blocked_s * 4 * result.num_exchanges - clean.blocked_s * 4 * clean.num_exchanges
    assert waited == pytest.approx(3 * (7.0 + lost), rel=1e-9)
    assert result.work_dropped_fraction == pytest.approx(lost / (4 * 80 + lost), rel=1e-12)
    assert result.to_dict()["num_steps_lost"] == lost and result.to_dict()["num_failures"] == 1


def test_the_same_seed_replays_the_same_failures():
    times = StepTimes(1.0, lognormal_sigma=0.2, straggler_fraction=0.1, failure_rate=0.02)
    setup = SimulationSetup("local", 16, 8 * 10, sync_every=8, fragments=2, delay=1, seed=7)
    first, second = (simulate_local_updates(setup, times, 0.5, 1000.0).to_dict() for _ in range(2))
    other = simulate_local_updates(replace(setup, seed=8), times, 0.5, 1000.0).to_dict()
    for result in (first, second, other):
        result.pop("wall_s")
    assert first == second and first["num_failures"] > 0
    assert other != first


@settings(max_examples=60, deadline=None)
@given(num_workers=st.integers(1, 12), sync_every=st.integers(1, 12), data=st.data(),
       failure_rate=st.floats(0.001, 0.2), sigma=st.sampled_from([0.0, 0.3]),
       stragglers=st.sampled_from([0.0, 0.25]), exchange_s=st.floats(0.0, 5.0),
       share=st.booleans(), seed=st.integers(0, 2**16))
def test_failures_never_make_a_run_faster(num_workers, sync_every, data, failure_rate, sigma, stragglers,
                                          exchange_s, share, seed):
    fragments = data.draw(st.integers(1, sync_every))
    delay = data.draw(st.integers(0, sync_every - 1))
    steps = 3 * sync_every + 1
    setup = SimulationSetup("local", num_workers, steps, sync_every=sync_every, fragments=fragments,
                            delay=delay, seed=seed, steps_per_worker=steps if share else None)
    times = StepTimes(1.0, sigma, stragglers, 3.0, failure_rate, detect_s=1.0, restart_s=4.0)
    failing = simulate_local_updates(setup, times, exchange_s, 1000.0)
    clean = simulate_local_updates(setup, replace(times, failure_rate=0.0), exchange_s, 1000.0)
    assert failing.samples_per_s <= clean.samples_per_s
    assert failing.virtual_time_s >= clean.virtual_time_s
    assert failing.num_exchanges == clean.num_exchanges  # the schedule is the data's, not the clock's
    assert (failing.num_steps_lost >= failing.num_failures) and (failing.num_failures > 0) == (
        failing.work_dropped_fraction > 0)


def test_the_command_replays_local_updates_with_failures_too():
    """`advise --simulate N --failure-rate P` adds the fastest configuration with local
    updates to its simulations, failures and all, as it does without them."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--simulate", "4", "--sim-steps", "40", "--failure-rate", "0.05"])
    results = command._simulations(args, cost_model())
    assert [r.setup.mode for r in results] == ["sync", "sync", "ssp", "async", "local"]
    local = results[-1]
    assert local.setup.sync_every == 8 and local.num_failures > 0 and local.work_dropped_fraction > 0
    assert local.to_dict()["num_steps_lost"] == local.num_steps_lost >= local.num_failures
