"""Membership rules with a fake clock: failure detection, exits, rejoins, duplicates,
generations, stragglers, recovery records, metrics and reloads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.coordinator.membership import (
    MAX_METRICS,
    DuplicateNode,
    Membership,
    NodeTableFull,
    RankTaken,
    UnknownNode,
    WrongProcess,
)
from disttrain.coordinator.nodes import Recovery
from disttrain.coordinator.reports import HeartbeatReport, NodeProcess

TIMEOUT_S = 5.0


@pytest.fixture
def membership() -> Membership:
    return Membership(heartbeat_timeout_s=TIMEOUT_S, straggler_factor=2.0)


def kinds(membership: Membership) -> list[tuple[str, str]]:
    return [(e.node_id, e.kind) for e in membership.take_events()]


def test_a_silent_node_fails_exactly_after_the_timeout(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(10))
    membership.heartbeat("worker-0", now=1.0, pid=10)
    assert membership.check(now=1.0 + TIMEOUT_S) == []
    assert membership.get("worker-0").state == "alive"
    failed = membership.check(now=1.0 + TIMEOUT_S + 0.001)
    assert [(e.node_id, e.kind) for e in failed] == [("worker-0", "failed")]
    assert membership.get("worker-0").state == "failed"
    assert membership.check(now=100.0) == []  # declared once


def test_a_node_that_never_heartbeats_fails_from_its_registration(membership):
    membership.register("server-0", "server", now=10.0, process=NodeProcess(1))
    assert membership.check(now=10.0 + TIMEOUT_S) == []
    assert [e.kind for e in membership.check(now=10.0 + TIMEOUT_S + 0.1)] == ["failed"]


def test_exit_code_zero_is_done_and_any_other_code_fails_at_once(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    membership.register("worker-1", "worker", now=0.0, process=NodeProcess(2))
    assert membership.exited("worker-0", 0, "", now=1.0)
    assert membership.exited("worker-1", -9, "killed by SIGKILL", now=1.0)
    assert membership.get("worker-0").state == "done"
    assert membership.get("worker-1").state == "failed"
    assert membership.get("worker-1").failure_reason == "killed by SIGKILL"
    assert not membership.exited("nobody", 1, "", now=1.0)
    assert membership.check(now=100.0) == []  # done and failed nodes are not checked


def test_a_failed_node_is_told_to_exit(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    membership.check(now=TIMEOUT_S + 1)
    assert membership.heartbeat("worker-0", now=TIMEOUT_S + 2, pid=1) is False


def test_rejoin_counts_restarts_and_starts_a_generation(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    membership.exited("worker-0", 1, "exit code 1", now=1.0)
    generation = membership.generation
    node = membership.register("worker-0", "worker", now=2.0, process=NodeProcess(2))
    assert (node.state, node.restarts, node.pid) == ("alive", 1, 2)
    assert membership.generation == generation + 1 == node.joined_generation
    assert kinds(membership)[-1] == ("worker-0", "restarted")


def test_a_new_process_replaces_a_silent_one_before_it_is_detected(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    node = membership.register("worker-0", "worker", now=TIMEOUT_S + 1, process=NodeProcess(2))
    assert (node.restarts, node.pid) == (1, 2)
    assert kinds(membership)[-2:] == [("worker-0", "failed"), ("worker-0", "restarted")]
    with pytest.raises(WrongProcess, match="pid 1"):  # the old process: refused, it must stop
        membership.heartbeat("worker-0", now=TIMEOUT_S + 2, pid=1)
    assert (membership.get("worker-0").pid, membership.get("worker-0").last_heartbeat) == (2, None)


def test_a_live_id_claimed_by_another_process_is_refused(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    membership.heartbeat("worker-0", now=3.0, pid=1)
    generation = membership.generation
    with pytest.raises(DuplicateNode, match=r"worker-0.*pid 1.*another id"):
        membership.register("worker-0", "worker", now=4.0, process=NodeProcess(2))
    assert membership.generation == generation
    assert membership.get("worker-0").pid == 1


def test_registering_again_from_the_same_process_changes_nothing(membership):
    first = membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    generation = membership.generation
    again = membership.register("worker-0", "worker", now=1.0, process=NodeProcess(1))
    assert again is first and again.restarts == 0 and membership.generation == generation


def test_heartbeat_from_an_unknown_node_says_register_first(membership):
    with pytest.raises(UnknownNode, match="register"):
        membership.heartbeat("ghost", now=0.0)


def test_bad_ids_and_roles_are_refused(membership):
    with pytest.raises(ValueError, match="empty"):
        membership.register("", "worker", now=0.0)
    with pytest.raises(ValueError, match="role 'boss'"):
        membership.register("x", "boss", now=0.0)


def test_every_membership_change_bumps_the_generation_and_heartbeats_do_not(membership):
    assert membership.generation == 0
    membership.register("a", "worker", now=0.0, process=NodeProcess(1))  # join
    membership.register("b", "worker", now=0.0, process=NodeProcess(2))  # join
    membership.heartbeat("a", now=1.0, pid=1, report=HeartbeatReport(step=3))
    assert membership.generation == 2
    membership.exited("b", 0, "", now=2.0)  # done
    membership.check(now=1.0 + TIMEOUT_S + 1)  # a fails
    membership.register("a", "worker", now=20.0, process=NodeProcess(3))  # rejoin
    assert membership.generation == 5
    assert [e.generation for e in membership.take_events()] == [1, 2, 3, 4, 5]


def step_times(membership: Membership, times: dict[str, float], role: str = "worker") -> None:
    for pid, (node_id, step_time_s) in enumerate(times.items(), start=1):
        membership.register(node_id, role, now=0.0, process=NodeProcess(pid))
        membership.heartbeat(node_id, now=1.0, pid=pid, report=HeartbeatReport(step_time_s=step_time_s))


def test_stragglers_are_slower_than_the_factor_times_the_median(membership):
    step_times(membership, {"w0": 0.10, "w1": 0.11, "w2": 0.12, "w3": 0.25})
    assert membership.stragglers() == {"w3"}
    # flagged once it has been slow for longer than the heartbeat timeout, not at once
    assert not [e for e in membership.check(now=1.5) if e.kind == "straggler"]
    for node_id in ("w0", "w1", "w2", "w3"):
        membership.heartbeat(node_id, now=1.0 + TIMEOUT_S, pid=int(node_id[1]) + 1,
                             report=HeartbeatReport(step_time_s={"w3": 0.25}.get(node_id, 0.1)))
    events = [e for e in membership.check(now=1.5 + TIMEOUT_S) if e.kind == "straggler"]
    assert [e.node_id for e in events] == ["w3"] and membership.get("w3").straggler
    assert membership.check(now=2.0 + TIMEOUT_S) == []  # announced once


def test_two_nodes_suffice_and_one_is_never_a_straggler(membership):
    step_times(membership, {"w0": 0.1, "w1": 0.5})
    assert membership.stragglers() == {"w1"}
    lone = Membership(TIMEOUT_S, 2.0)
    step_times(lone, {"w0": 5.0})
    assert lone.stragglers() == set()


def test_stragglers_compare_within_one_role(membership):
    step_times(membership, {"w0": 0.1, "w1": 0.1})
    step_times(membership, {"s0": 1.0, "s1": 1.1}, role="server")
    assert membership.stragglers() == set()


def test_recovery_record_after_a_missed_heartbeat(membership):
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1))
    membership.heartbeat("w0", now=2.0, pid=1)
    membership.check(now=7.5)  # detected 5.5 s after the last heartbeat
    membership.register("w0", "worker", now=9.0, process=NodeProcess(2))
    assert membership.take_recoveries() == []  # not before its first heartbeat
    membership.heartbeat("w0", now=10.0, pid=2)
    assert membership.take_recoveries(clock_offset_s=1000.0) == [
        Recovery("w0", "no heartbeat for 5.50s", detect_s=5.5, recover_s=2.5, time=1010.0,
                 generation=membership.generation)]
    assert membership.take_recoveries() == []  # taken once
    recovered = [e for e in membership.take_events() if e.kind == "recovered"]
    assert recovered[0].detail == ("back at work 2.500s after it failed (no heartbeat for 5.50s; "
                                   "declared 5.500s after its last heartbeat)")


def test_recovery_after_a_reported_exit_has_no_detection_delay(membership):
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1))
    membership.exited("w0", -9, "killed by SIGKILL", now=3.0)
    membership.register("w0", "worker", now=4.0, process=NodeProcess(2))
    membership.heartbeat("w0", now=4.5, pid=2)
    (recovery,) = membership.take_recoveries()
    assert (recovery.node_id, recovery.reason, recovery.detect_s, recovery.recover_s, recovery.time) == (
        "w0", "killed by SIGKILL", 0.0, 1.5, 4.5)
    assert [e.detail for e in membership.take_events() if e.kind == "recovered"] == [
        "back at work 1.500s after it failed (killed by SIGKILL; its exit was reported)"]


def test_a_finished_node_that_rejoins_is_no_recovery(membership):
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1))
    membership.exited("w0", 0, "", now=1.0)
    membership.register("w0", "worker", now=2.0, process=NodeProcess(2))
    membership.heartbeat("w0", now=3.0, pid=2)
    assert membership.take_recoveries() == []


def test_metrics_keep_the_latest_value_of_each_key_across_a_restart(membership):
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1))
    membership.report_metrics("w0", 10, {"loss/train": 0.9, "accuracy/test": 0.7})
    membership.report_metrics("w0", 20, {"loss/train": 0.5})
    node = membership.get("w0")
    assert (node.metrics, node.metrics_step) == ({"loss/train": 0.5, "accuracy/test": 0.7}, 20)
    membership.exited("w0", -9, "killed by SIGKILL", now=1.0)
    membership.register("w0", "worker", now=2.0, process=NodeProcess(2))  # its latest known figures stay
    assert membership.get("w0").metrics == {"loss/train": 0.5, "accuracy/test": 0.7}
    membership.report_metrics("w0", 12, {"loss/train": 0.6})  # the new process, resumed earlier
    assert (membership.get("w0").metrics["loss/train"], membership.get("w0").metrics_step) == (0.6, 12)
    assert membership.generation == 3 and all(e.kind != "metrics" for e in membership.take_events())
    with pytest.raises(UnknownNode, match="register"):
        membership.report_metrics("ghost", 1, {"loss/train": 1.0})


def test_metrics_that_are_not_finite_or_too_many_are_refused_and_change_nothing(membership):
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1))
    membership.report_metrics("w0", 10, {"loss/train": 0.9})
    with pytest.raises(ValueError, match="loss/train not finite"):
        membership.report_metrics("w0", 11, {"loss/train": float("nan"), "accuracy/train": 0.5})
    too_many = {f"custom/{i}": 1.0 for i in range(MAX_METRICS)}  # with loss/train, one too many
    with pytest.raises(ValueError, match=f"more than {MAX_METRICS} keys"):
        membership.report_metrics("w0", 12, too_many)
    assert (membership.get("w0").metrics, membership.get("w0").metrics_step) == ({"loss/train": 0.9}, 10)


def test_a_reload_keeps_everything_and_gives_live_nodes_a_fresh_window(membership):
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1, capabilities={"cpus": 4}))
    membership.register("w1", "worker", now=0.0, process=NodeProcess(2))
    membership.heartbeat("w0", now=1.0, pid=1, report=HeartbeatReport(epoch=1, step=42, throughput=100.0))
    membership.report_metrics("w0", 40, {"loss/train": 0.25})
    membership.exited("w1", 1, "exit code 1", now=1.0)
    rows = membership.to_rows(clock_offset_s=1000.0)
    assert rows[0]["last_heartbeat"] == 1001.0  # on the wall clock

    reloaded = Membership(TIMEOUT_S, 2.0)
    reloaded.restore(rows, membership.generation, now=500.0, clock_offset_s=2000.0)
    w0, w1 = reloaded.get("w0"), reloaded.get("w1")
    assert (w0.state, w0.step, w0.epoch, w0.capabilities) == ("alive", 42, 1, {"cpus": 4})
    assert (w0.metrics, w0.metrics_step) == ({"loss/train": 0.25}, 40)
    assert w0.last_heartbeat == 1001.0 - 2000.0  # its true age is kept
    assert w1.state == "failed" and reloaded.generation == membership.generation
    assert reloaded.check(now=500.0 + TIMEOUT_S) == []  # a fresh window, not a mass failure
    assert [e.node_id for e in reloaded.check(now=500.0 + TIMEOUT_S + 0.1)] == ["w0"]


def test_a_reloaded_nodes_window_starts_when_the_coordinator_serves_not_when_it_reloaded(membership):
    # a restarted coordinator's start-up (from its reload to its listening) is time in which
    # no node could reach it: it must not count against the nodes' heartbeat timeout
    membership.register("w0", "worker", now=0.0, process=NodeProcess(1))
    membership.register("w1", "worker", now=0.0, process=NodeProcess(2))
    reloaded = Membership(TIMEOUT_S, 2.0)
    reloaded.restore(membership.to_rows(), membership.generation, now=100.0)
    reloaded.heartbeat("w1", now=101.0, pid=2)  # heard from before it served: its window runs
    reloaded.opened(now=103.0)
    assert [e.node_id for e in reloaded.check(now=101.0 + TIMEOUT_S + 0.1)] == ["w1"]
    assert reloaded.check(now=103.0 + TIMEOUT_S) == []  # w0's window opened with the coordinator
    assert [e.node_id for e in reloaded.check(now=103.0 + TIMEOUT_S + 0.1)] == ["w0"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["register", "heartbeat", "exit", "check"]),
                          st.integers(0, 2), st.integers(1, 3), st.floats(0.0, 4.0)), max_size=40))
def test_generation_never_decreases_and_counts_every_state_change(actions):
    membership = Membership(heartbeat_timeout_s=2.0)
    now = 0.0
    for action, index, pid, dt in actions:
        now += dt
        node_id = f"w{index}"
        try:
            if action == "register":
                membership.register(node_id, "worker", now=now, process=NodeProcess(pid))
            elif action == "heartbeat":
                membership.heartbeat(node_id, now=now, pid=pid)
            elif action == "exit":
                membership.exited(node_id, pid - 1, "", now=now)
            else:
                membership.check(now)
        except (DuplicateNode, UnknownNode, WrongProcess):
            pass
    events = membership.take_events()
    changes = [e for e in events if e.kind in ("joined", "failed", "restarted", "done")]
    assert membership.generation == len(changes)
    assert [e.generation for e in changes] == list(range(1, len(changes) + 1))
    assert all(n.state in ("alive", "failed", "done") for n in membership.members())


def test_after_a_reload_a_restarted_process_is_not_taken_for_a_duplicate():
    first = Membership(TIMEOUT_S, 2.0)
    first.register("w0", "worker", now=0.0, process=NodeProcess(1))
    reloaded = Membership(TIMEOUT_S, 2.0)
    reloaded.restore(first.to_rows(), first.generation, now=100.0)
    # pid 1 died while the coordinator was down; its restart registers before any heartbeat
    node = reloaded.register("w0", "worker", now=100.5, process=NodeProcess(2))
    assert node.pid == 2 and node.restarts == 1
    with pytest.raises(DuplicateNode):  # heard from now: a second live process is refused
        reloaded.register("w0", "worker", now=101.0, process=NodeProcess(3))


def test_a_heartbeat_of_another_pid_or_none_is_refused_and_changes_nothing(membership):
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(7))
    membership.take_events()
    for pid in (0, 8):
        with pytest.raises(WrongProcess):
            membership.heartbeat("worker-0", now=1.0, pid=pid, report=HeartbeatReport(step=99))
    node = membership.get("worker-0")
    assert (node.step, node.last_heartbeat, node.state) == (0, None, "alive")
    # a hung process heartbeating under pid 0 keeps nobody alive: silence still fails it
    assert [e.kind for e in membership.check(now=TIMEOUT_S + 0.1)] == ["failed"]


def test_an_exit_report_of_another_process_or_generation_is_refused(membership):
    node = membership.register("worker-0", "worker", now=0.0, process=NodeProcess(7))
    for pid, generation in ((8, node.joined_generation), (7, node.joined_generation + 1)):
        with pytest.raises(WrongProcess):
            membership.exited("worker-0", 1, "forged", now=1.0, pid=pid, generation=generation)
    assert membership.get("worker-0").state == "alive"
    assert membership.exited("worker-0", 1, "killed", now=1.0, pid=7, generation=node.joined_generation)
    assert membership.get("worker-0").state == "failed"


def test_a_rank_stays_its_first_nodes_whatever_its_state(membership):
    """Another node never takes a rank (found by an insider: a worker took the rank of one
    that failed, whose restart was then refused), and a node never leaves its own."""
    membership.register("worker-0", "worker", now=0.0, rank=0, process=NodeProcess(1))
    with pytest.raises(RankTaken, match="worker rank 0 is node 'worker-0''s"):
        membership.register("squatter", "worker", now=1.0, rank=0, process=NodeProcess(2))
    assert membership.get("squatter") is None
    # another role: its own ranks
    membership.register("rank-0", "rank", now=1.0, rank=0, process=NodeProcess(3))
    membership.exited("worker-0", 1, "killed", now=2.0)
    with pytest.raises(RankTaken, match=r"\(failed\)"):
        membership.register("worker-0b", "worker", now=3.0, rank=0, process=NodeProcess(4))
    membership.register("worker-1", "worker", now=3.0, rank=1, process=NodeProcess(5))
    with pytest.raises(RankTaken, match="holds worker rank 1, not 0"):
        membership.register("worker-1", "worker", now=4.0, rank=0, process=NodeProcess(5))
    # its own restart
    restarted = membership.register("worker-0", "worker", now=5.0, rank=0, process=NodeProcess(6))
    assert restarted.rank == 0 and restarted.restarts == 1 and restarted.state == "alive"
    assert membership.register("worker-0", "worker", now=6.0, rank=-1,
                               process=NodeProcess(6)).rank == 0  # kept


def test_a_full_table_forgets_the_oldest_ended_nodes_done_first_and_refuses_when_all_live():
    membership = Membership(TIMEOUT_S, max_nodes=3)
    for pid, node_id in enumerate(("a", "b", "c"), start=1):
        membership.register(node_id, "worker", now=float(pid), process=NodeProcess(pid))
    membership.exited("a", 1, "killed", now=4.0)  # failed, older
    membership.exited("b", 0, "", now=5.0)  # done: forgotten first
    membership.changes_saved()
    membership.register("d", "worker", now=6.0, process=NodeProcess(4))
    assert [n.node_id for n in membership.members()] == ["a", "c", "d"]
    membership.register("e", "worker", now=7.0, process=NodeProcess(5))
    assert [n.node_id for n in membership.members()] == ["c", "d", "e"]
    rows, forgotten = membership.changes()
    assert forgotten == ["a", "b"] and [row["node_id"] for row in rows] == ["d", "e"]
    with pytest.raises(NodeTableFull, match="max_nodes"):
        membership.register("f", "worker", now=8.0, process=NodeProcess(6))
    assert [n.node_id for n in membership.members()] == ["c", "d", "e"]


def test_changes_name_only_the_nodes_changed_since_the_last_save(membership):
    for pid in range(1, 4):
        membership.register(f"w{pid}", "worker", now=0.0, process=NodeProcess(pid))
    membership.changes_saved()
    assert membership.changes() == ([], [])
    membership.heartbeat("w2", now=1.0, pid=2, report=HeartbeatReport(step=5))
    rows, _ = membership.changes()
    assert [(row["node_id"], row["step"]) for row in rows] == [("w2", 5)]


def test_a_registry_past_the_limit_reloads_its_live_and_latest_nodes_and_forgets_the_rest():
    large = Membership(TIMEOUT_S, max_nodes=10)
    for pid in range(1, 7):
        large.register(f"w{pid}", "worker", now=float(pid), process=NodeProcess(pid))
        if pid != 2:
            large.exited(f"w{pid}", 1, "killed", now=float(pid))
    small = Membership(TIMEOUT_S, max_nodes=3)
    small.restore(large.to_rows(), large.generation, now=100.0)
    assert [n.node_id for n in small.members()] == ["w2", "w5", "w6"]  # live, then the latest heard
    assert small.changes() == ([], ["w1", "w3", "w4"])
