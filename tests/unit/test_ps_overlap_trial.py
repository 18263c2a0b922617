"""The overlap trial's pure choice: the first steps alternate overlapped and plain pushes
by the step's parity, after untimed warm-up steps, and the side with the lower median
step time is kept; a tie keeps the plain push. Timings are injected."""

from __future__ import annotations

import pytest

from disttrain.strategies.ps.worker.overlap_trial import OverlapTrial

pytestmark = pytest.mark.timeout(30)


def run(trial: OverlapTrial, seconds: dict[bool, list[float]], first_step: int = 1) -> list[bool]:
    """Step `trial` until it chooses, each side taking its next time from `seconds`
    (warm-up steps take 100 s: they must not count); the sides the steps used."""
    used, step, left = [], first_step, {side: list(times) for side, times in seconds.items()}
    while trial.chosen is None:
        side = trial.overlaps(step)
        warm = len(used) < trial.warmup_steps
        used.append(side)
        trial.record(side, 100.0 if warm else left[side].pop(0))
        step += 1
        assert step < 100, "the trial never chose"
    return used


@pytest.mark.parametrize(("overlapped", "plain", "kept"), [
    ([1.0, 1.1, 5.0], [1.2, 1.3, 1.25], True),     # overlap faster at the median (one outlier)
    ([1.3, 1.2, 1.4], [1.0, 9.0, 1.1], False),     # plain faster at the median (one outlier)
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], False),     # a tie keeps the plain push
])
def test_the_trial_keeps_the_side_with_the_lower_median(overlapped, plain, kept):
    trial = OverlapTrial(steps_each=3)
    used = run(trial, {True: overlapped, False: plain})
    assert trial.chosen is kept
    assert used[:2] == [True, True]  # the warm-up steps overlap, untimed
    assert used[2:].count(True) == 3 and used[2:].count(False) == 3
    assert trial.median(True) == pytest.approx(sorted(overlapped)[1])
    assert trial.median(False) == pytest.approx(sorted(plain)[1])
    # the choice holds for every later step, whatever its parity
    assert [trial.overlaps(step) for step in range(20, 24)] == [kept] * 4
    assert not trial.record(not kept, 0.001) and trial.chosen is kept
    assert ("keeping the overlapped push" if kept else "keeping the plain push") in trial.describe()


def test_sides_alternate_by_the_steps_parity_so_workers_in_lockstep_try_the_same_side():
    trial = OverlapTrial(steps_each=2, warmup_steps=0)
    assert [trial.overlaps(step) for step in (7, 8)] == [True, False]
    used = run(trial, {True: [1.0, 1.0], False: [2.0, 2.0]}, first_step=7)
    assert used == [True, False, True, False]
    assert trial.chosen is True


def test_a_side_with_its_timings_gives_its_steps_to_the_other():
    trial = OverlapTrial(steps_each=2, warmup_steps=0)
    # only odd steps come (another parity rule upstream): the plain side still gets its timings
    for step in (1, 3, 5, 7):
        trial.record(trial.overlaps(step), 1.0)
    assert trial.timed == {True: [1.0, 1.0], False: [1.0, 1.0]}
    assert trial.chosen is False


@pytest.mark.parametrize(("kwargs", "message"), [({"steps_each": 0}, "steps_each must be >= 1"),
                                                 ({"steps_each": 1, "warmup_steps": -1}, "warmup_steps")])
def test_a_trial_of_no_steps_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OverlapTrial(**kwargs)
