"""Two more of the options `advise` prices, on numbers worked by hand: Streaming DiLoCo's
delay tau (a fragment's exchange hidden behind the tau inner steps after it, DDP and the
parameter server alike), the parameter server's fragments (groups of whole shards), and
the parameter server's overlap trial (a worker keeps the overlapped push only where it is
more than 2% faster than the plain one, in the formulas and in the simulation)."""

from __future__ import annotations

import pytest

from disttrain.advise import (
    Candidate,
    CompressionCost,
    CostModel,
    Link,
    SimulationSetup,
    StepTimes,
    Workload,
    simulate,
)
from disttrain.advise.comparison import candidate_of
from disttrain.config import load_config
from disttrain.strategies.ps.worker.overlap_trial import MIN_GAIN

MB = 1e6
INNER_S = 0.3 + 0.01  # one inner step: forward and backward, then the worker's optimizer


def workload() -> Workload:
    costs = {"quantization": CompressionCost("quantization", 0.01, int(10 * MB), 0.01, 0.004)}
    return Workload("test", 10_000_000, int(40 * MB), 10, 32, 0.1, 0.2, 0.01, 0.0, "given", costs)


# -- Streaming DiLoCo's delay ----------------------------------------------------------------


def test_a_delay_hides_a_ddp_exchange_behind_its_inner_steps_by_hand():
    fast = CostModel(workload(), Link(1e8, 1e-3))
    n, h, f = 4, 8, 4
    # one fragment of 10 MB all-reduced flat: 2·3/4 of it, 2·3 latencies
    exchange = 2 * 3 / 4 * 10 * MB / 1e8 + 6e-3
    waits = fast.predict(Candidate("ddp", "none", 0, h, fragments=f), n)
    hidden = fast.predict(Candidate("ddp", "none", 0, h, fragments=f, delay=1), n)
    assert waits.step_time_s == pytest.approx(INNER_S + f * exchange / h)
    assert hidden.details["exchange_s"] == pytest.approx(exchange)
    # 0.156 s of exchange beside a 0.31 s inner step: nothing left to wait for
    assert hidden.step_time_s == pytest.approx(INNER_S)
    assert hidden.details["longest_step_s"] == pytest.approx(INNER_S)
    assert hidden.bytes_per_step == pytest.approx(waits.bytes_per_step)
    assert hidden.details["peak_bytes"] == pytest.approx(waits.details["peak_bytes"])
    assert hidden.label() == "ddp H=8 F=4 tau=1"
    assert hidden.to_dict()["outer_delay"] == 1


def test_a_delay_hides_only_what_its_inner_steps_last_and_the_link_still_bounds_the_mean():
    slow = CostModel(workload(), Link(1e7, 1e-3))
    n, h, f = 4, 8, 4
    exchange = 2 * 3 / 4 * 10 * MB / 1e7 + 6e-3  # 1.506 s a fragment
    one = slow.predict(Candidate("ddp", "none", 0, h, fragments=f, delay=1), n)
    blocked = exchange - INNER_S
    assert one.details["longest_step_s"] == pytest.approx(INNER_S + blocked)
    assert one.step_time_s == pytest.approx(INNER_S + f * blocked / h)
    # four inner steps would hide all but 0.27 s, but the link carries one exchange after
    # another: F exchanges every H steps take F·exchange/H a step whatever the delay
    four = slow.predict(Candidate("ddp", "none", 0, h, fragments=f, delay=4), n)
    assert four.details["longest_step_s"] == pytest.approx(INNER_S + exchange - 4 * INNER_S)
    assert four.step_time_s == pytest.approx(f * exchange / h)
    assert four.step_time_s > INNER_S + f * (exchange - 4 * INNER_S) / h


def test_a_delay_with_int8_pseudo_gradients_hides_their_gathered_exchange():
    model = CostModel(workload(), Link(1e8, 1e-3))
    n, f = 4, 2
    waits = model.predict(Candidate("ddp", "none", 0, 8, fragments=f, outer="int8"), n)
    hidden = model.predict(Candidate("ddp", "none", 0, 8, fragments=f, outer="int8", delay=2), n)
    exchange = waits.details["exchange_s"]
    assert exchange == pytest.approx(3 * 10 * MB / f / 1e8 + 3e-3 + (0.01 + n * 0.004) / f)
    assert hidden.step_time_s == pytest.approx(INNER_S) and INNER_S < waits.step_time_s
    assert waits.step_time_s == pytest.approx(INNER_S + f * exchange / 8)


# -- the parameter server's fragments and delay ------------------------------------------------


def test_parameter_server_fragments_cut_each_exchange_to_its_shards_by_hand():
    model = CostModel(workload(), Link(1e9, 1e-3))
    h = 8
    # 2 workers on 4 shards: a worker's own link bounds its push and pull, and a fragment
    # of 2 shards halves them
    whole = model.predict(Candidate("ps-sync", "none", 4, h), 2)
    halves = model.predict(Candidate("ps-sync", "none", 4, h, fragments=2), 2)
    assert whole.details["exchange_s"] == pytest.approx(2 * (40 * MB / 1e9 + 1e-3) + 0.01 / 4)
    assert halves.details["exchange_s"] == pytest.approx(2 * (20 * MB / 1e9 + 1e-3) + 0.01 / 4)
    assert halves.step_time_s == pytest.approx(INNER_S + 2 * halves.details["exchange_s"] / h)
    assert halves.details["peak_bytes"] == pytest.approx(whole.details["peak_bytes"] / 2) == 40 * MB
    assert halves.bytes_per_step == pytest.approx(whole.bytes_per_step)
    assert halves.label() == "ps-sync S=4 H=8 F=2"
    # 8 workers on 4 shards: a shard's link carries n/S of everyone's slices, and a fragment's
    # shards carry as much as before: half the bytes at once, no shorter, twice as often
    crowded = model.predict(Candidate("ps-sync", "none", 4, h), 8)
    crowded_halves = model.predict(Candidate("ps-sync", "none", 4, h, fragments=2), 8)
    assert crowded_halves.details["exchange_s"] == pytest.approx(crowded.details["exchange_s"])
    assert crowded_halves.details["peak_bytes"] == pytest.approx(crowded.details["peak_bytes"] / 2)
    assert crowded_halves.step_time_s > crowded.step_time_s


def test_a_delay_hides_a_parameter_server_fragments_push_and_pull():
    model = CostModel(workload(), Link(1e9, 1e-3))
    waits = model.predict(Candidate("ps-sync", "none", 4, 8, fragments=2), 2)
    hidden = model.predict(Candidate("ps-sync", "none", 4, 8, fragments=2, delay=1), 2)
    assert waits.details["exchange_s"] < INNER_S  # 42.5 ms beside a 310 ms inner step
    assert hidden.step_time_s == pytest.approx(INNER_S)
    assert hidden.details["longest_step_s"] == pytest.approx(INNER_S)
    assert hidden.label() == "ps-sync S=4 H=8 F=2 tau=1"


# -- the overlap trial -----------------------------------------------------------------------


def trial_models(contention_s: float) -> tuple[CostModel, CostModel, CostModel]:
    """(the trial's, overlap forced, plain) on a link where 4 shards' pushes take 0.4 s."""
    link = Link(1e8, 1e-3)
    return (CostModel(workload(), link, overlap_contention_s=contention_s),
            CostModel(workload(), link, overlap_trial=False, overlap_contention_s=contention_s),
            CostModel(workload(), link, overlap=False))


@pytest.mark.parametrize("contention_s, overlap_kept", [
    (0.0, True), (0.05, True),
    (0.185, False),  # 10 ms faster overlapped: under 2% of the 1.1 s plain step, not a clear win
    (0.3, False),
])
def test_the_overlap_trial_keeps_the_overlap_only_on_a_clear_win(contention_s, overlap_kept):
    trial, forced, plain = trial_models(contention_s)
    candidate, n = Candidate("ps-sync", "none", 4), 4
    push = max(40 * MB / 1e8, 4 * 40 * MB / 4e8) + 1e-3
    # the raw push's 40 pieces (10 MB shards, 10 pieces each) stream as backward writes
    # them: all but the last leave during backward (0.2 s), less what the push's CPU work
    # takes from backward where no core is free
    assert trial.push_pieces(candidate) == 40
    credit = min(0.2, push) * 39 / 40 - contention_s
    steps = {name: model.predict(candidate, n).step_time_s
             for name, model in (("trial", trial), ("forced", forced), ("plain", plain))}
    assert steps["forced"] == pytest.approx(steps["plain"] - credit)
    # the worker's rule (`overlap_trial.judge`): the overlap only where it saves more than
    # MIN_GAIN of the plain step
    assert (credit > MIN_GAIN * steps["plain"]) is overlap_kept
    assert steps["trial"] == pytest.approx(steps["forced"] if overlap_kept else steps["plain"])
    assert trial.round_trip(candidate, n).overlap_s == pytest.approx(credit if overlap_kept else 0.0)


def test_the_simulated_step_takes_the_side_the_trial_keeps():
    trial, forced, _ = trial_models(0.3)  # the overlapped push is the slower here
    candidate, n = Candidate("ps-sync", "none", 4), 4
    for model in (trial, forced):
        predicted = model.predict(candidate, n).step_time_s
        result = simulate(SimulationSetup("sync", n, 20, batch_size=32), StepTimes(model.workload.compute_s),
                          model.round_trip(candidate, n))
        assert result.time_per_update_s == pytest.approx(predicted, rel=1e-9)
    assert trial.predict(candidate, n).step_time_s < forced.predict(candidate, n).step_time_s


def test_a_runs_streaming_config_with_a_delay_is_the_candidate_it_ran():
    keys = {"training.sync_every": 8, "training.outer_fragments": 2, "training.outer_delay": 2,
            "training.outer_mixing": 0.5, "ps.num_servers": 2}
    config = load_config(None, keys, [])
    assert candidate_of({"strategy": "ddp"}, config) == Candidate("ddp", "none", 0, 8, fragments=2, delay=2)
    ps = Candidate("ps-sync", "none", 2, 8, fragments=2, delay=2)
    assert candidate_of({"strategy": "ps"}, config) == ps
