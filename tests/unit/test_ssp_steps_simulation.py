"""The simulation's SSP by steps: the bound holds workers instead of dropping their work,
a bound beyond the run is async exactly, and tau = 0 runs at the stragglers' pace."""

from __future__ import annotations

import pytest

from disttrain.advise import RoundTrip, SimulationSetup, StepTimes, simulate

TRIP = RoundTrip(encode_s=0.01, overlap_s=0.0, push_s=0.05, service_s=0.001, apply_s=0.002, pull_s=0.05)


@pytest.mark.parametrize("tau", [0, 2])
def test_stragglers_hold_the_others_and_no_work_is_dropped(tau):
    times = StepTimes(1.0, straggler_fraction=4 / 32)
    ssp = simulate(SimulationSetup("ssp", 32, 32 * 40, staleness_bound=tau), times, TRIP)
    sync = simulate(SimulationSetup("sync", 32, 40), times, TRIP)
    asynchronous = simulate(SimulationSetup("async", 32, 32 * 40), times, TRIP)
    assert ssp.num_rejected_stale == 0 and ssp.work_dropped_fraction == 0 and ssp.num_pushes == 32 * 40
    assert sync.samples_per_s <= ssp.samples_per_s < asynchronous.samples_per_s
    # every worker runs at the stragglers' pace: 3 s of compute and a round trip a step
    assert ssp.samples_per_s == pytest.approx(32 * 64 / (3.0 + 0.113), rel=0.05)


def test_a_bound_beyond_the_run_is_async_exactly():
    times = StepTimes(1.0, lognormal_sigma=0.4, straggler_fraction=0.1)
    ssp = simulate(SimulationSetup("ssp", 16, 16 * 30, staleness_bound=10**6), times, TRIP)
    asynchronous = simulate(SimulationSetup("async", 16, 16 * 30), times, TRIP)
    assert ssp.to_dict() | {"mode": "async", "staleness_bound": 2, "wall_s": 0} == \
        asynchronous.to_dict() | {"wall_s": 0}


def test_failed_workers_stop_holding_the_others_once_the_run_drops_them():
    times = StepTimes(1.0, failure_rate=0.02, detect_s=5.0, restart_s=10.0)
    result = simulate(SimulationSetup("ssp", 8, 8 * 60, staleness_bound=1, seed=1), times, TRIP)
    assert result.num_updates == 8 * 60 and result.num_failures > 0 and result.num_rejected_stale == 0


def test_an_unknown_clock_is_refused():
    with pytest.raises(ValueError, match="ssp clock 'ticks' is not one of steps, versions"):
        SimulationSetup("ssp", 4, ssp_clock="ticks")
