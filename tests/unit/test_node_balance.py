"""A node's balance state in the membership, with a fake clock: a heartbeat's batch,
warm-up speed and plans (its BalanceState) are kept (0: unknown, the value held stays),
a rise in plans is one "rebalanced" event and no new generation, a restarted process
starts over, and a reload keeps the state without calling it a re-plan."""

from __future__ import annotations

import pytest

from disttrain.coordinator.membership import Membership
from disttrain.coordinator.reports import BalanceState, HeartbeatReport, NodeProcess

TIMEOUT_S = 5.0


@pytest.fixture
def membership() -> Membership:
    membership = Membership(heartbeat_timeout_s=TIMEOUT_S)
    membership.register("rank1", "rank", now=0.0, rank=1, process=NodeProcess(7))
    membership.take_events()  # the join
    return membership


def balance(node) -> tuple[int, float, int]:
    return node.batch_size, node.warmup_speed, node.plans


def test_a_first_report_is_kept_and_is_no_event(membership):
    membership.heartbeat("rank1", now=1.0, pid=7, report=HeartbeatReport(balance=BalanceState(64, 812.5, 1)))
    assert balance(membership.get("rank1")) == (64, 812.5, 1)
    assert membership.take_events() == []


def test_a_rise_in_plans_is_one_rebalanced_event_without_a_new_generation(membership):
    membership.heartbeat("rank1", now=1.0, pid=7, report=HeartbeatReport(balance=BalanceState(64, 812.5, 1)))
    generation = membership.generation
    replanned = BalanceState(batch_size=96, plans=2)  # the speed is not resent
    membership.heartbeat("rank1", now=2.0, pid=7, report=HeartbeatReport(balance=replanned))
    # the same plan again
    membership.heartbeat("rank1", now=3.0, pid=7, report=HeartbeatReport(balance=replanned))
    events = membership.take_events()
    assert [(e.node_id, e.kind, e.detail, e.time) for e in events] == [
        ("rank1", "rebalanced", "batch 64 -> 96 (plan 2)", 2.0)]
    assert events[0].generation == membership.generation == generation
    assert balance(membership.get("rank1")) == (96, 812.5, 2)  # the speed was not resent: kept


def test_zeros_and_older_senders_keep_what_is_known(membership):
    membership.heartbeat("rank1", now=1.0, pid=7, report=HeartbeatReport(balance=BalanceState(48, 300.0, 3)))
    # no balance state: what is known stays
    membership.heartbeat("rank1", now=2.0, pid=7, report=HeartbeatReport(step=5))
    assert balance(membership.get("rank1")) == (48, 300.0, 3)
    # fewer plans is no re-plan
    membership.heartbeat("rank1", now=3.0, pid=7, report=HeartbeatReport(balance=BalanceState(plans=2)))
    assert membership.take_events() == [] and membership.get("rank1").plans == 2


def test_a_rise_from_unknown_plans_or_with_an_unknown_batch_says_so(membership):
    membership.heartbeat("rank1", now=1.0, pid=7, report=HeartbeatReport(balance=BalanceState(plans=1)))
    membership.heartbeat("rank1", now=2.0, pid=7, report=HeartbeatReport(balance=BalanceState(plans=3)))
    assert [e.detail for e in membership.take_events()] == ["batch ? -> ? (plan 3)"]


def test_a_restarted_process_starts_its_balance_state_over(membership):
    membership.heartbeat("rank1", now=1.0, pid=7, report=HeartbeatReport(balance=BalanceState(96, 812.5, 4)))
    membership.exited("rank1", -9, "killed by SIGKILL", now=2.0)
    node = membership.register("rank1", "rank", now=3.0, rank=1, process=NodeProcess(8))
    assert balance(node) == (0, 0.0, 0)
    membership.heartbeat("rank1", now=4.0, pid=8, report=HeartbeatReport(balance=BalanceState(64, 800.0, 1)))
    assert [e.kind for e in membership.take_events()] == ["failed", "restarted", "recovered"]


def test_a_reload_keeps_the_state_and_a_later_rise_is_still_seen(membership):
    membership.heartbeat("rank1", now=1.0, pid=7, report=HeartbeatReport(balance=BalanceState(64, 812.5, 1)))
    reloaded = Membership(TIMEOUT_S)
    reloaded.restore(membership.to_rows(1000.0), membership.generation, now=50.0, clock_offset_s=1000.0)
    assert balance(reloaded.get("rank1")) == (64, 812.5, 1)
    reloaded.heartbeat("rank1", now=51.0, pid=7,
                       report=HeartbeatReport(balance=BalanceState(batch_size=64, plans=1)))
    reloaded.heartbeat("rank1", now=52.0, pid=7,
                       report=HeartbeatReport(balance=BalanceState(batch_size=80, plans=2)))
    assert [e.detail for e in reloaded.take_events()] == ["batch 64 -> 80 (plan 2)"]
