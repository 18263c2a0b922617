"""The restart budget (`coordinator.budget`), stepped by hand: a process that dies after
making progress is restarted for free, one that dies again without progress spends the
budget, a user's error stops at once, the same unexpected error at the same step on a
fresh start stops at once. Also the event lines that carry a process's progress and error
to its supervisor (`core.processes`), and the budget of a DDP rank group under torch's
elastic agent (`strategies.ddp.agent`)."""

import inspect
import json

import pytest
import torch.distributed.launcher.api as launcher_api
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from disttrain.coordinator.budget import Decision, ErrorReport, RestartBudget, error_class
from disttrain.core.checkpoint import save_checkpoint
from disttrain.core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DistributedError,
    DisttrainError,
    TrainingError,
)
from disttrain.core.processes import EVENT_PREFIX, PARENT_ENV, Child, ProgressReport, report_error
from disttrain.strategies.ddp.agent import GroupBudget, budgeted_agent, group_failure, rank_error

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


def test_a_users_error_that_says_how_to_go_on_is_not_told_it_twice():
    budget = RestartBudget(max_restarts=5)
    budget.started(0.0)
    message = ("checkpoint store s3://b/run/worker1: writing checkpoint_step00000010.pt failed for 60s; the "
               "newest complete checkpoint there is step 5; once the store works again, run the same "
               "command with --resume")
    verdict = budget.exited(2.0, 30, ErrorReport("CheckpointStoreError", message, False))
    line = verdict.stop_line("worker1", "exited with code 74", KEY)
    assert line == f"worker1: {message} (not restarted: a restart would fail the same way)"
    assert line.count("--resume") == 1


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


# -- DDP restart mode: torch's agent restarts the group as the budget grants ---------------------

def failure(tmp_path, rank, exitcode, message=None):
    """torch's record of a failed rank, with the error file the rank left (`Kind: message`)."""
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "", "timestamp": "0"}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_a_group_with_a_killed_rank_failed_from_outside_whatever_the_others_said(tmp_path):
    reason, error = group_failure({0: failure(tmp_path, 0, 1, "DistributedError: lost contact with rank 1"),
                                   1: failure(tmp_path, 1, -9)})
    assert (reason, error) == ("failed (rank 1 killed by SIGKILL)", None)
    # the group's stop (SIGTERM) of a lower rank, seen at the same time, is not the cause
    assert group_failure({0: failure(tmp_path, 0, -15), 1: failure(tmp_path, 1, -9)})[0] == \
        "failed (rank 1 killed by SIGKILL)"
    assert group_failure({0: failure(tmp_path, 0, -15), 1: failure(tmp_path, 1, -15)})[0] == \
        "failed (rank 0 killed by SIGTERM)"


def test_a_groups_error_is_a_users_first_then_an_unexpected_one_then_a_fault(tmp_path):
    lost = failure(tmp_path, 0, 1, "DistributedError: lost contact with another rank")
    bug = failure(tmp_path, 1, 1, "ValueError: batch 4 does not fit this model")
    diverged = failure(tmp_path, 2, 1, "disttrain.core.errors.TrainingError: diverged at step 3")
    assert group_failure({0: lost, 1: bug, 2: diverged}) == (
        "failed (rank 2 exited with code 1)", ErrorReport("TrainingError", "diverged at step 3", False))
    assert group_failure({0: lost, 1: bug}) == (
        "failed (rank 1 exited with code 1)", ErrorReport("ValueError", "batch 4 does not fit this model"))
    assert group_failure({0: lost})[1] == ErrorReport("DistributedError", "lost contact with another rank",
                                                      True)
    # exit code 2 without a file: bad input; nothing said: not classed
    assert rank_error(2, "") == ErrorReport("ConfigError", "exit code 2", False)
    assert rank_error(1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html") \
        is None


def test_the_group_budget_counts_checkpoints_past_the_newest_as_progress_and_stops_a_crash_loop(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(folder, 5, {"step": 5})  # a resumed run's: where it starts, not progress
    clock = iter(float(t) for t in range(100))
    budget = GroupBudget(1, str(folder), clock=lambda: next(clock))
    killed = {1: failure(tmp_path, 1, -9)}
    assert budget.failed(killed).decision is Decision.RESTART_SPENDING  # no checkpoint since: spends
    save_checkpoint(folder, 10, {"step": 10})
    assert budget.failed(killed).decision is Decision.RESTART  # checkpointed past 5: whole again
    assert budget.failed(killed).decision is Decision.RESTART_SPENDING
    assert budget.stop_error() is None
    assert budget.failed(killed).decision is Decision.STOP_CRASH_LOOP
    error = budget.stop_error()
    assert isinstance(error, DistributedError) and str(error).startswith(
        "the rank group failed (rank 1 killed by SIGKILL) without progress (never past checkpoint step 10, "
        "its furthest), 2 time(s) in a row (ddp.max_restarts=1): a crash loop")


def test_the_group_budget_stops_at_once_on_a_ranks_users_error(tmp_path):
    budget = GroupBudget(3, str(tmp_path / "ckpt"))
    verdict = budget.failed({0: failure(tmp_path, 0, 1, "TrainingError: diverged at step 3"),
                             1: failure(tmp_path, 1, 1, "DistributedError: lost contact with rank 0")})
    assert verdict.decision is Decision.STOP_USER_ERROR
    error = budget.stop_error()
    assert isinstance(error, TrainingError)
    assert str(error).startswith("rank 0: diverged at step 3 (not restarted: a restart would fail the same "
                                 "way)")


def test_torchs_agent_still_has_what_the_budgeted_agent_relies_on():
    assert callable(getattr(LocalElasticAgent, "_monitor_workers", None))
    assert "_remaining_restarts" in inspect.getsource(SimpleElasticAgent._invoke_run)
    # the restart count the ranks get (their attempt) goes on counting up
    assert "max_restarts - self._remaining_restarts" in inspect.getsource(SimpleElasticAgent)
    assert hasattr(launcher_api, "LocalElasticAgent")
    with budgeted_agent(GroupBudget(1, "unused")):
        assert launcher_api.LocalElasticAgent is not LocalElasticAgent
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_an_error_report_is_read_back_as_the_projects_error_class_of_its_name():
    assert error_class("TrainingError") is TrainingError and error_class("ConfigError") is ConfigError
    assert error_class("ValueError") is None and error_class("error_lines") is None  # not an error class
    report = rank_error(1, "DataError: digits: no such file")
    assert report == ErrorReport("DataError", "digits: no such file", False)
