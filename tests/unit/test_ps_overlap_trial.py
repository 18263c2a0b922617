"""The overlap trial's pure choice: after untimed warm-up steps, the first steps run
overlapped and plain pushes in ABBA pairs, and the overlap is kept only where the median
of the pairs' gains beats both the gains' spread and a floor; a near-tie, a noisy sample
or a load that drifts during the trial keeps the plain push. Sequential: undecided after
a round of pairs, the trial runs another, up to a cap; a tie or a loss stops at once.
Timings are injected."""

from __future__ import annotations

import pytest

from disttrain.strategies.ps.worker.overlap_trial import MAX_ROUNDS, OverlapTrial, judge

pytestmark = pytest.mark.timeout(30)


def run(trial: OverlapTrial, seconds: dict[bool, list[float]]) -> list[bool]:
    """Step `trial` until it chooses, each side taking its next time from `seconds`
    (warm-up steps take 100 s: they must not count); the sides the steps used."""
    used, left = [], {side: list(times) for side, times in seconds.items()}
    while trial.chosen is None:
        side = trial.overlaps()
        warm = len(used) < trial.warmup_steps
        used.append(side)
        trial.record(side, 100.0 if warm else left[side].pop(0))
        assert len(used) < 100, "the trial never chose"
    return used


def run_on_a_clock(trial: OverlapTrial, step_s) -> list[bool]:
    """Step `trial` until it chooses, step `i` (from 0, warm-up included) of side `side`
    taking `step_s(i, side)` seconds; the sides the steps used."""
    used = []
    while trial.chosen is None:
        side = trial.overlaps()
        trial.record(side, step_s(len(used), side))
        used.append(side)
        assert len(used) < 100, "the trial never chose"
    return used


CLEAR_WIN = ([0.80, 0.85, 0.82, 0.90], [1.00, 1.05, 1.01, 1.08])
# medians 1.125 against 1.15: the lower median alone would keep the overlap, but the pairs
# disagree (gains +0.10, -0.10, +0.10, -0.05: median 0.025, spread 0.075)
NOISY_NEAR_TIE = ([1.00, 1.30, 0.95, 1.25], [1.10, 1.20, 1.05, 1.20])


@pytest.mark.parametrize(("overlapped", "plain", "kept"), [
    (*CLEAR_WIN, True),
    (*NOISY_NEAR_TIE, False),
    ([1.0, 1.1, 5.0, 1.0], [1.2, 1.3, 1.25, 1.2], True),   # a clear win with one outlier step
    ([1.3, 1.2, 1.4, 1.3], [1.0, 9.0, 1.1, 1.0], False),   # plain faster, one outlier step
    ([1.0] * 4, [1.0] * 4, False),                         # a tie keeps the plain push
    ([0.995] * 4, [1.0] * 4, False),                       # a steady win under the 2% floor
])
def test_the_trial_keeps_the_overlap_only_on_a_clear_win(overlapped, plain, kept):
    trial = OverlapTrial(steps_each=4, max_rounds=1)  # one round: the rule on 4 pairs
    used = run(trial, {True: overlapped, False: plain})
    assert trial.chosen is kept and judge(overlapped, plain).keep_overlap is kept
    assert used[:2] == [True, True]  # the warm-up steps overlap, untimed
    assert used[2:] == [True, False, False, True, True, False, False, True]  # ABBA pairs
    assert trial.timed == {True: overlapped, False: plain}
    # the choice holds for every later step
    assert [trial.overlaps() for _ in range(4)] == [kept] * 4
    assert not trial.record(not kept, 0.001) and trial.chosen is kept
    assert ("keeping the overlapped push" if kept else "keeping the plain push") in trial.describe()


def test_the_margin_is_the_gains_spread_or_the_floor_whichever_is_larger():
    verdict = judge(*NOISY_NEAR_TIE)
    assert verdict.gain_s == pytest.approx(0.025) and verdict.spread_s == pytest.approx(0.075)
    assert verdict.needed_s == pytest.approx(0.075) and not verdict.keep_overlap
    steady = judge([0.9] * 4, [1.0] * 4)
    assert steady.spread_s == pytest.approx(0.0) and steady.needed_s == pytest.approx(0.02)
    assert steady.keep_overlap
    assert not judge([0.9] * 4, [1.0] * 4, min_gain=0.2).keep_overlap


def test_a_load_rising_through_the_trial_does_not_pick_the_slower_overlap():
    """Every step takes 0.1 s longer than the one before (the machine filling up) and the
    overlap is truly 0.05 s slower: in pairs that always ran overlapped first, the drift
    would make it look 0.05 s faster in each of them; in ABBA pairs it favours each side
    in half of them and shows as spread."""
    trial = OverlapTrial(steps_each=4)
    run_on_a_clock(trial, lambda i, side: 1.0 + 0.1 * i + (0.05 if side else 0.0))
    assert trial.verdict.gain_s == pytest.approx(-0.05)
    assert trial.verdict.spread_s == pytest.approx(0.1)
    assert trial.chosen is False
    always_overlapped_first = [(1.0 + 0.2 * i + 0.05, 1.0 + 0.2 * i + 0.1) for i in range(4)]
    overlapped, plain = zip(*always_overlapped_first, strict=True)
    assert judge(overlapped, plain).keep_overlap


def test_a_clear_win_survives_a_drifting_load():
    trial = OverlapTrial(steps_each=4)
    run_on_a_clock(trial, lambda i, side: 1.0 + 0.1 * i - (0.3 if side else 0.0))
    assert trial.verdict.gain_s == pytest.approx(0.3) and trial.chosen is True


# gains +0.12, -0.10, +0.10, 0.00: median 0.05, spread 0.06: positive, not beyond the margin
UNDECIDED = ([0.88, 1.10, 0.90, 1.00], [1.00, 1.00, 1.00, 1.00])


def test_an_undecided_round_runs_another_and_a_clear_win_by_eight_pairs_keeps_the_overlap():
    first = judge(*UNDECIDED)
    assert first.gain_s == pytest.approx(0.05) and first.needed_s == pytest.approx(0.06)
    assert first.undecided and not first.keep_overlap
    more = ([0.90] * 4, [1.00] * 4)  # four more pairs, each 0.10 faster overlapped
    eight = judge(UNDECIDED[0] + more[0], UNDECIDED[1] + more[1])
    assert eight.gain_s == pytest.approx(0.10) and eight.keep_overlap and not eight.undecided
    trial = OverlapTrial(steps_each=4)
    used = run(trial, {True: UNDECIDED[0] + more[0], False: UNDECIDED[1] + more[1]})
    assert trial.chosen is True and len(trial.pairs) == 8
    assert used[2:] == [True, False, False, True] * 4  # ABBA through both rounds
    assert trial.verdict == eight and "over 8 step(s) each" in trial.describe()


@pytest.mark.parametrize(("overlapped", "plain"), [
    ([1.3, 1.2, 1.4, 1.3], [1.0, 1.1, 1.0, 1.2]),  # a clear loss
    ([1.0] * 4, [1.0] * 4),                        # a tie
])
def test_a_loss_or_a_tie_stops_after_the_first_round_with_the_plain_push(overlapped, plain):
    assert not judge(overlapped, plain).undecided
    trial = OverlapTrial(steps_each=4)
    used = run(trial, {True: overlapped, False: plain})  # no time for a second round: it must stop
    assert trial.chosen is False and len(trial.pairs) == 4 and len(used) == 2 + 8


def test_undecided_at_the_cap_keeps_the_plain_push():
    trial = OverlapTrial(steps_each=4)
    rounds = MAX_ROUNDS
    used = run(trial, {True: UNDECIDED[0] * rounds, False: UNDECIDED[1] * rounds})
    assert len(trial.pairs) == 4 * rounds == 12 and len(used) == 2 + 2 * 12
    assert trial.verdict.undecided and trial.chosen is False
    assert "undecided at the cap; keeping the plain push" in trial.describe()
    # a steady win under the floor is undecided too: the cap ends it
    small = OverlapTrial(steps_each=2, warmup_steps=0, max_rounds=2)
    run(small, {True: [0.995] * 4, False: [1.0] * 4})
    assert small.chosen is False and len(small.pairs) == 4


def test_a_side_repeated_by_the_caller_reopens_its_pair():
    trial = OverlapTrial(steps_each=2, warmup_steps=0)
    for side, seconds in [(True, 9.0), (True, 1.0), (False, 2.0), (False, 2.0), (True, 1.0)]:
        trial.record(side, seconds)
    assert trial.pairs == [(1.0, 2.0), (1.0, 2.0)]
    assert trial.chosen is True


@pytest.mark.parametrize(("kwargs", "message"), [({"steps_each": 0}, "steps_each must be >= 1"),
                                                 ({"steps_each": 1, "warmup_steps": -1}, "warmup_steps"),
                                                 ({"steps_each": 1, "min_gain": -0.1}, "min_gain"),
                                                 ({"steps_each": 1, "max_rounds": 0}, "max_rounds")])
def test_a_trial_of_no_steps_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OverlapTrial(**kwargs)


def test_unpaired_times_are_refused():
    with pytest.raises(ValueError, match="as many overlapped as plain"):
        judge([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        judge([], [])
