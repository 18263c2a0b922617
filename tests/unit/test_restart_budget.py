"""The restart budget (`coordinator.budget`), stepped by hand: a process that dies after
making progress is restarted for free, one that dies again without progress spends the
budget, a user's error stops at once, the same unexpected error at the same step on a
fresh start stops at once. Also the event lines that carry a process's progress and error
to its supervisor (`core.processes`)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.coordinator.budget import Decision, ErrorReport, RestartBudget
from disttrain.core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DistributedError,
    DisttrainError,
    TrainingError,
)
from disttrain.core.processes import EVENT_PREFIX, PARENT_ENV, Child, ProgressReport, report_error

KEY = "coordinator.max_restarts"


def die(budget, now, reached, error=None):
    """One start of the process: it runs until `now`, reaches `reached`, and dies."""
    verdict = budget.exited(now, reached, error)
    if verdict.restart:
        budget.started(now)
    return verdict


def test_a_process_killed_after_progress_is_restarted_without_spending_and_goes_on_for_ever():
    budget = RestartBudget(max_restarts=1)
    budget.started(0.0)
    # killed every 15 s, each time a few steps past where the one before got: 50 kills, budget 1
    for kill in range(50):
        verdict = die(budget, 15.0 * (kill + 1), 10 + 7 * kill)
        assert verdict.decision is Decision.RESTART and verdict.progressed
        assert verdict.spent == 0 and verdict.uptime_s == 15.0
    line = verdict.restart_line("worker1", "killed by SIGKILL", KEY)
    assert "without spending its restart budget" in line and "past step 346" in line
    assert line.startswith("worker1 killed by SIGKILL 15.0s after its start, after reaching step 353")


def test_deaths_without_progress_spend_the_budget_and_stop_the_run_after_max_restarts_in_a_row():
    budget = RestartBudget(max_restarts=2)
    budget.started(0.0)
    assert die(budget, 5.0, 12).decision is Decision.RESTART  # got to step 12 from nothing
    # resumed from its step-10 checkpoint, it dies at step 11, 12, 12: never past 12
    first = die(budget, 6.0, 11)
    assert first.decision is Decision.RESTART_SPENDING and first.spent == 1
    assert "restart 1 of at most 2 in a row without progress (coordinator.max_restarts)" in \
        first.restart_line("worker1", "killed by SIGKILL", KEY)
    assert die(budget, 7.0, 12).decision is Decision.RESTART_SPENDING
    last = die(budget, 8.0, 12)
    assert last.decision is Decision.STOP_CRASH_LOOP and not last.restart
    line = last.stop_line("worker1", "killed by SIGKILL", KEY)
    assert line.startswith("worker1 killed by SIGKILL without progress (never past step 12, its furthest), "
                           "3 time(s) in a row (coordinator.max_restarts=2): a crash loop")
    assert "--resume" in line and "the cluster was stopped" in line
    assert last.stop_line("worker1", "killed by SIGKILL", KEY, given_up=True).endswith("not started again")


def test_progress_makes_the_budget_whole_again():
    budget = RestartBudget(max_restarts=1)
    budget.started(0.0)
    assert die(budget, 1.0, None).decision is Decision.RESTART_SPENDING  # died before its first step
    assert die(budget, 2.0, 4).decision is Decision.RESTART  # then got somewhere: budget whole again
    assert budget.spent == 0
    assert die(budget, 3.0, 4).decision is Decision.RESTART_SPENDING
    assert die(budget, 4.0, 3).decision is Decision.STOP_CRASH_LOOP


def test_a_process_that_never_reports_progress_stops_after_max_restarts_plus_one_failures():
    budget = RestartBudget(max_restarts=3)
    budget.started(0.0)
    decisions = [die(budget, float(t), None).decision for t in range(4)]
    assert decisions == [Decision.RESTART_SPENDING] * 3 + [Decision.STOP_CRASH_LOOP]
    assert "before making any progress, 4 time(s) in a row" in \
        budget.exited(9.0, None).stop_line("server0", "exited with code 1", KEY)


def test_zero_restarts_turns_restarts_off_even_after_progress():
    budget = RestartBudget(max_restarts=0)
    budget.started(0.0)
    verdict = budget.exited(3.0, 40)
    assert verdict.decision is Decision.STOP_CRASH_LOOP
    line = verdict.stop_line("rank1", "killed by SIGKILL", "ddp.max_restarts")
    assert "restarts are off (ddp.max_restarts=0)" in line and "raise" not in line


@pytest.mark.parametrize("error", [ConfigError("training.lr: -1 must be > 0"), DataError("no such data set"),
                                   CheckpointError("ckpt_5.pt is truncated"),
                                   TrainingError("the gradient of step 3 holds NaN")])
def test_a_users_error_stops_at_once_whatever_the_budget_and_the_progress(error):
    budget = RestartBudget(max_restarts=5)
    budget.started(0.0)
    report = ErrorReport(type(error).__name__, str(error), error.recoverable)
    verdict = budget.exited(2.0, 30, report)  # progress, and the whole budget left: still stops
    assert verdict.decision is Decision.STOP_USER_ERROR and not verdict.restart
    line = verdict.stop_line("worker1", "exited with code 1", KEY)
    assert line.startswith(f"worker1: {error}") and "not restarted" in line


def test_the_same_unexpected_error_at_the_same_step_on_a_fresh_start_stops_at_once():
    budget = RestartBudget(max_restarts=5)
    budget.started(0.0)
    bug = ErrorReport("ValueError", "mat1 and mat2 shapes cannot be multiplied (32x64 and 65x10)")
    assert die(budget, 1.0, 7, bug).decision is Decision.RESTART  # once may be a fault
    verdict = die(budget, 2.0, 7, bug)
    assert verdict.decision is Decision.STOP_REPEATED_ERROR
    line = verdict.stop_line("worker1", "exited with code 1", KEY)
    assert line.startswith("worker1 failed with the same error after step 7 on a fresh start, so it is a bug")
    assert bug.message in line


def test_an_unexpected_error_before_any_step_twice_is_a_bug_too():
    budget = RestartBudget(max_restarts=5)
    budget.started(0.0)
    bug = ErrorReport("ImportError", "No module named 'my_model'")
    assert die(budget, 1.0, None, bug).decision is Decision.RESTART_SPENDING
    verdict = die(budget, 2.0, None, bug)
    assert verdict.decision is Decision.STOP_REPEATED_ERROR
    assert "before its first step" in verdict.stop_line("server1", "exited with code 1", KEY)


def test_errors_that_differ_in_kind_message_or_step_or_are_not_consecutive_are_retried():
    budget = RestartBudget(max_restarts=10)
    budget.started(0.0)
    error = ErrorReport("OSError", "No space left on device")
    assert die(budget, 1.0, 7, error).restart
    assert die(budget, 2.0, 9, error).restart  # another step
    assert die(budget, 3.0, 9, ErrorReport("OSError", "Connection reset")).restart  # another message
    assert die(budget, 4.0, 9, ErrorReport("RuntimeError", "Connection reset")).restart  # another kind
    assert die(budget, 5.0, 9).restart  # killed by a signal between the two
    assert die(budget, 6.0, 9, ErrorReport("RuntimeError", "Connection reset")).restart


def test_a_fault_that_says_so_is_never_taken_for_a_bug():
    budget = RestartBudget(max_restarts=2)
    budget.started(0.0)
    lost = ErrorReport("DistributedError", "server 1 unreachable", DistributedError.recoverable)
    assert die(budget, 1.0, 5, lost).decision is Decision.RESTART
    assert die(budget, 2.0, 5, lost).decision is Decision.RESTART_SPENDING  # the same, but a fault
    assert die(budget, 3.0, 5, lost).decision is Decision.RESTART_SPENDING
    verdict = die(budget, 4.0, 5, lost)
    assert verdict.decision is Decision.STOP_CRASH_LOOP
    line = verdict.stop_line("worker0", "exited with code 1", KEY)
    assert "(DistributedError: server 1 unreachable)" in line


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        RestartBudget(-1)


@settings(max_examples=300, deadline=None)
@given(max_restarts=st.integers(1, 4),
       points=st.lists(st.one_of(st.none(), st.integers(0, 30)), min_size=1, max_size=40))
def test_generated_kill_schedules_stop_exactly_at_the_first_run_of_failures_without_progress(max_restarts,
                                                                                              points):
    """Whatever the points the starts reach before they are killed (none, behind, past the
    furthest), the run stops at the first exit that makes `max_restarts + 1` exits in a
    row without progress past every earlier one, and not before."""
    budget = RestartBudget(max_restarts)
    budget.started(0.0)
    furthest, in_a_row = None, 0
    for t, point in enumerate(points):
        moved = point is not None and (furthest is None or point > furthest)
        furthest = point if moved else furthest
        in_a_row = 0 if moved else in_a_row + 1
        verdict = die(budget, float(t + 1), point)
        assert verdict.progressed == moved
        assert verdict.restart == (in_a_row <= max_restarts), (t, point)
        if not verdict.restart:
            assert verdict.decision is Decision.STOP_CRASH_LOOP
            break
        assert verdict.spent == in_a_row


def read_events(text):
    lines = text.splitlines()
    return [json.loads(line[len(EVENT_PREFIX):]) for line in lines if line.startswith(EVENT_PREFIX)]


def heard(events):
    child = Child("worker1", None, None)
    for event in events:
        fields = dict(event)
        child.heard(fields.pop("event"), fields)
    return child


def test_progress_is_reported_once_per_new_furthest_point_and_kept_on_the_child(monkeypatch, capsys):
    monkeypatch.setenv(PARENT_ENV, "1")
    report = ProgressReport()
    for point in (0, 3, 3, 2, 5, 4, 9):  # a shard's versions fall back after a restore
        report(point)
    events = read_events(capsys.readouterr().out)
    assert [e["point"] for e in events] == [0, 3, 5, 9]
    assert heard(events).furthest == 9


@pytest.mark.parametrize("error,recoverable", [(TrainingError("diverged at step 3"), False),
                                               (DistributedError("lost server 0"), True),
                                               (DisttrainError("registry locked"), None),
                                               (ValueError("bad shape\ntraceback detail"), None)])
def test_a_processs_error_reaches_its_supervisor_with_whether_a_restart_may_mend_it(monkeypatch, capsys,
                                                                                    error, recoverable):
    monkeypatch.setenv(PARENT_ENV, "1")
    report_error(error)
    child = heard(read_events(capsys.readouterr().out))
    assert child.error == {"exception": type(error).__name__, "recoverable": recoverable,
                           "message": str(error).splitlines()[0]}


def test_nothing_is_printed_outside_a_launcher(monkeypatch, capsys):
    monkeypatch.delenv(PARENT_ENV, raising=False)
    ProgressReport()(4)
    report_error(TrainingError("diverged"))
    assert capsys.readouterr().out == ""
