"""The pieces of a DDP rank group's preemption that need no process group: the spacing of
the agreement's rounds, a rank's SIGTERM handler (first, second, grace, stopped), and how
the launcher reads the ranks' lines."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from disttrain.core import checkpoint as ckpt
from disttrain.strategies.ddp.preemption import (
    MAX_SPACING,
    NOT_SAVED,
    GroupStop,
    RankSignal,
    group_stop,
    proposed_spacing,
    stopped_line,
    stopped_step,
)


@given(st.floats(0.0, 100.0), st.integers(1, MAX_SPACING), st.floats(0.001, 1.0))
def test_the_spacing_is_between_one_point_and_the_cap_and_covers_about_the_interval(elapsed_s, points,
                                                                                    interval_s):
    spacing = proposed_spacing(elapsed_s, points, interval_s)
    assert 1 <= spacing <= MAX_SPACING
    if elapsed_s > 0 and spacing < MAX_SPACING:
        per_point_s = elapsed_s / points
        # Never more than the interval (but one point), about the interval when points are short.
        assert spacing == 1 or spacing * per_point_s <= interval_s * (1 + 1e-9)
        assert (spacing + 1) * per_point_s > interval_s * (1 - 1e-9)


def test_a_first_sigterm_raises_the_flag_and_a_second_ends_the_rank():
    ended = []
    rank_signal = RankSignal(1, grace_s=60, expire=ended.append)
    rank_signal.handle()
    assert rank_signal.requested.is_set() and ended == []
    rank_signal.handle()
    assert len(ended) == 1 and ended[0].startswith("rank 1: a second SIGTERM") and NOT_SAVED in ended[0]
    rank_signal.stopped()


def test_the_grace_period_ends_a_rank_that_has_not_stopped():
    ended = threading.Event()
    lines = []
    rank_signal = RankSignal(0, grace_s=0.05, expire=lambda line: (lines.append(line), ended.set()))
    rank_signal.handle()
    assert ended.wait(10)
    assert "within 0.05s of the SIGTERM (system.preemption_grace_s)" in lines[0] and NOT_SAVED in lines[0]


def test_a_rank_stopped_with_its_checkpoint_ignores_later_signals_and_its_grace():
    ended = []
    rank_signal = RankSignal(0, grace_s=0.01, expire=ended.append)
    rank_signal.handle()
    rank_signal.stopped()
    rank_signal.handle()  # the agent stopping the ranks still exiting
    assert rank_signal._timer is not None
    rank_signal._timer.join(5)
    assert ended == []


def test_the_launcher_reads_the_agreed_step_from_any_rank_that_stopped_with_it():
    stopped = {"message": f"Preempted: {stopped_line(12)}", "extraInfo": {}}
    expired = f"Preempted: rank 1: a second SIGTERM came before the ranks stopped; {NOT_SAVED}"
    assert stopped_step(stopped_line(12)) == 12
    assert group_stop([stopped, expired]) == GroupStop(12)
    assert group_stop([expired, "DistributedError: lost contact with another rank"]) == GroupStop(
        None, expired[len("Preempted: "):])
    assert group_stop(["DistributedError: lost contact", "", None]) is None


def test_the_launcher_line_names_the_checkpoint_or_the_newest_one(tmp_path):
    assert GroupStop(7).line(str(tmp_path)) == (
        f"preempted at step 7: every rank stopped there with its checkpoint ({ckpt.checkpoint_name(7)}); "
        "run the same command with --resume to go on")
    assert GroupStop(None, "why").line(str(tmp_path)) == (
        "preempted: why; there is no checkpoint yet: run the same command to start over")
    ckpt.save_checkpoint(tmp_path, 4, {"step": 4}, keep=3)
    newest = ckpt.latest_checkpoint(tmp_path)
    assert GroupStop(None, "why").line(str(tmp_path)) == (
        f"preempted: why; the newest checkpoint is {newest} (step 4): run the same command with --resume "
        "to go on from it")
