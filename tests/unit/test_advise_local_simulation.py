"""`advise --simulate` replays local updates step by step (`advise.local_simulation`):
with constant step times its mean step is the cost model's `streaming_step_s`, Streaming
DiLoCo's fragments cut the largest exchange to 1/F of the bytes, a delay hides what its
inner steps cover, and a straggler holds up every exchange."""

from __future__ import annotations

import pytest

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
    with pytest.raises(ValueError, match="failures"):
        simulate_local_updates(SimulationSetup("local", 4, sync_every=4), StepTimes(1.0, failure_rate=0.1),
                               1.0, 1.0)
    with pytest.raises(ValueError, match="no local updates"):
        cost_model().fragment_exchange(Candidate("ddp"), 4)
