"""The simulation drives the parameter server's own aggregation rules in virtual time:
with constant step times its synchronous result is the cost model's, and stragglers,
backup workers, SSP, async and failures change it the way the rules say."""

from __future__ import annotations

import pytest

from disttrain.advise import (
    Candidate,
    CompressionCost,
    CostModel,
    Link,
    RoundTrip,
    SimulationSetup,
    StepTimes,
    Workload,
    simulate,
)

TRIP = RoundTrip(encode_s=0.01, overlap_s=0.0, push_s=0.05, service_s=0.001, apply_s=0.002, pull_s=0.05)


def cost_model(overlap: bool) -> CostModel:
    costs = {"topk": CompressionCost("topk", 0.01, 10**5, 0.02, 0.005)}
    workload = Workload("test", 10**7, 4 * 10**7, 20, 32, 0.1, 0.2, 0.03, 0.0, "given", costs)
    return CostModel(workload, Link(1.25e8, 2e-4), overlap=overlap)


@pytest.mark.parametrize("num_workers, num_servers, compression, overlap", [
    (1, 1, "none", False), (4, 2, "none", True), (16, 4, "topk", True), (64, 64, "none", True),
])
def test_sync_with_constant_step_times_equals_the_cost_model(num_workers, num_servers, compression, overlap):
    model = cost_model(overlap)
    candidate = Candidate("ps-sync", compression, num_servers)
    predicted = model.predict(candidate, num_workers)
    result = simulate(SimulationSetup("sync", num_workers, 30, batch_size=32),
                      StepTimes(model.workload.compute_s), model.round_trip(candidate, num_workers))
    assert result.num_updates == 30
    assert result.time_per_update_s == pytest.approx(predicted.step_time_s, rel=1e-9)
    assert result.samples_per_s == pytest.approx(predicted.samples_per_s, rel=0.05)  # first step's start
    assert result.staleness_histogram == {0: 30 * num_workers}
    assert result.work_dropped_fraction == 0


def test_async_with_constant_step_times_approaches_the_cost_model():
    model = cost_model(overlap=False)
    candidate = Candidate("ps-async", "none", 1)
    for n in (2, 64):
        predicted = model.predict(candidate, n)
        result = simulate(SimulationSetup("async", n, 400 * n, batch_size=32),
                          StepTimes(model.workload.compute_s), model.round_trip(candidate, n))
        assert result.samples_per_s == pytest.approx(predicted.samples_per_s, rel=0.1)


def test_stragglers_slow_sync_and_backup_workers_drop_their_work():
    times = StepTimes(1.0, straggler_fraction=2 / 16)
    sync = simulate(SimulationSetup("sync", 16, 50), times, TRIP)
    backup = simulate(SimulationSetup("sync", 16, 50, backup_workers=2), times, TRIP)
    constant = simulate(SimulationSetup("sync", 16, 50), StepTimes(1.0), TRIP)
    assert sync.time_per_update_s == pytest.approx(constant.time_per_update_s + 2.0, rel=0.01)  # 3x slower
    assert backup.time_per_update_s == pytest.approx(constant.time_per_update_s, rel=0.01)
    assert backup.num_dropped_late > 0 and 0 < backup.work_dropped_fraction <= 2 / 16
    assert sync.num_dropped_late == 0


def test_ssp_by_versions_never_applies_a_gradient_staler_than_its_bound():
    result = simulate(SimulationSetup("ssp", 8, 800, staleness_bound=3, ssp_clock="versions"),
                      StepTimes(1.0, lognormal_sigma=0.5), TRIP)
    assert max(result.staleness_histogram) <= 3
    assert result.num_rejected_stale > 0 and result.work_dropped_fraction > 0


def test_async_applies_everything_and_staleness_grows_with_the_workers():
    small = simulate(SimulationSetup("async", 4, 400), StepTimes(1.0, lognormal_sigma=0.3), TRIP)
    large = simulate(SimulationSetup("async", 64, 6400), StepTimes(1.0, lognormal_sigma=0.3), TRIP)
    assert small.work_dropped_fraction == 0 and large.work_dropped_fraction == 0
    assert sum(large.staleness_histogram.values()) == 6400

    def mean(histogram):
        return sum(k * v for k, v in histogram.items()) / sum(histogram.values())

    assert mean(large.staleness_histogram) > 8 * mean(small.staleness_histogram)


def test_failed_workers_leave_the_quorum_and_sync_goes_on():
    times = StepTimes(1.0, failure_rate=0.02, detect_s=5.0, restart_s=10.0)
    result = simulate(SimulationSetup("sync", 8, 200, seed=1), times, TRIP)
    assert result.num_updates == 200 and result.num_failures > 0
    constant = simulate(SimulationSetup("sync", 8, 200), StepTimes(1.0), TRIP)
    assert result.time_per_update_s > constant.time_per_update_s


def test_a_thousand_workers_simulate_in_seconds():
    result = simulate(SimulationSetup("async", 1024, 100 * 1024), StepTimes(1.0, lognormal_sigma=0.2), TRIP)
    assert result.num_updates == 100 * 1024 and result.wall_s < 20
    sync = simulate(SimulationSetup("sync", 1024, 5), StepTimes(1.0), TRIP)
    assert sync.num_updates == 5


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="mode"):
        SimulationSetup("bulk", 4)
    with pytest.raises(ValueError, match="straggler fraction"):
        StepTimes(1.0, straggler_fraction=2)


@pytest.mark.parametrize("mode, backup_workers", [("sync", 0), ("sync", 1), ("ssp", 0)])
def test_with_a_share_of_the_data_each_the_slowest_worker_ends_the_run(mode, backup_workers):
    """Each of 2 workers has 10 steps of data, one of them 3x slower: whatever the rules
    drop, every step is computed, and the run ends when the slow worker's last one does."""
    trip = RoundTrip(encode_s=0.0, overlap_s=0.0, push_s=0.01, service_s=0.0, apply_s=0.0, pull_s=0.01)
    setup = SimulationSetup(mode, 2, 20, staleness_bound=2, backup_workers=backup_workers, batch_size=8,
                            steps_per_worker=10)
    result = simulate(setup, StepTimes(1.0, straggler_fraction=0.5, straggler_factor=3.0), trip)
    assert result.num_pushes == 20
    assert result.virtual_time_s == pytest.approx(10 * (3.0 + 0.02), rel=0.01)
    if mode in ("sync", "ssp") and not backup_workers:  # ssp by steps waits, dropping nothing
        assert result.work_dropped_fraction == 0
    else:  # the fast worker's steps go on without the slow one's, which come late
        assert 0 < result.work_dropped_fraction <= 0.5


def test_a_share_of_the_data_must_be_a_step_at_least():
    with pytest.raises(ValueError, match="steps_per_worker 0 must be >= 1"):
        SimulationSetup("sync", 2, 10, steps_per_worker=0)


@pytest.mark.slow  # 1,024 workers, 100 steps each, twice: seconds of work
def test_ssp_at_1024_workers_with_stragglers_drops_nothing_and_keeps_up_with_sync_in_bounded_work():
    """The issue's run (SimpleCNN on digits, 50 ms steps, 1 Gbit/s, 5% stragglers 3x
    slower, tau = 2): SSP by steps drops no push and reaches at least sync's samples/s;
    the work is bounded by events counted, not by the machine's clock: each push is at
    most three events (its arrival, its turn at the shard, its worker's pull)."""
    workload = Workload("simplecnn", 53_002, 4 * 53_002, 8, 32, 0.05 / 3, 0.1 / 3, 0.0005, 0.0, "given")
    model = CostModel(workload, Link(1.25e8, 2e-4))
    n, steps = 1024, 100
    best = max((model.predict(Candidate("ps-sync", "none", s), n) for s in (1, 2, 4, 8, 16, 32, 64)),
               key=lambda p: p.samples_per_s).candidate
    times = StepTimes(0.05, straggler_fraction=0.05)
    sync = simulate(SimulationSetup("sync", n, steps, batch_size=32), times, model.round_trip(best, n))
    async_trip = model.round_trip(Candidate("ps-async", "none", best.num_servers), n)
    ssp = simulate(SimulationSetup("ssp", n, steps * n, staleness_bound=2, batch_size=32), times, async_trip)
    assert ssp.num_rejected_stale == ssp.num_dropped_late == 0 and ssp.work_dropped_fraction == 0
    assert ssp.num_updates == steps * n and ssp.samples_per_s >= sync.samples_per_s
    for result in (sync, ssp):
        assert 0 < result.num_events <= 3 * (result.num_pushes + n)
