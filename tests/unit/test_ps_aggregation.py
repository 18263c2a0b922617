"""Aggregation rules with no sockets and a hand-stepped clock."""

import pytest

from disttrain.strategies.ps.aggregation import AggregationRules, Outcome, PushRefused


def rules(mode, world_size=2, **kwargs):
    r = AggregationRules(mode, world_size, **kwargs)
    for rank in range(world_size):
        assert r.register(f"w{rank}") == rank
    return r


def test_sync_waits_for_every_worker_then_applies_by_weight_in_rank_order():
    r = rules("sync", 3)
    assert r.offer("w2", 1, 0, 10.0, "g2", now=1.0).outcome is Outcome.BUFFERED
    assert r.offer("w0", 1, 0, 30.0, "g0", now=2.0).outcome is Outcome.BUFFERED
    assert r.version == 0
    decision = r.offer("w1", 1, 0, 60.0, "g1", now=4.5)
    assert decision.outcome is Outcome.APPLIED and decision.version == 1 == r.version
    assert [(c.rank, c.payload, c.weight) for c in decision.apply] == [
        (0, "g0", 0.3),
        (1, "g1", 0.6),
        (2, "g2", 0.1),
    ]
    assert r.round_wait_s == pytest.approx(3.5)
    assert r.counts["samples"] == 100 and r.staleness_histogram == {0: 3}


def test_sync_refuses_a_second_gradient_for_the_same_step_and_future_versions():
    r = rules("sync")
    r.offer("w0", 1, 0, 1.0, "a", now=0.0)
    with pytest.raises(PushRefused, match="already pushed"):
        r.offer("w0", 2, 0, 1.0, "b", now=0.0)
    with pytest.raises(PushRefused, match="ahead"):
        r.offer("w1", 1, 5, 1.0, "c", now=0.0)
    with pytest.raises(PushRefused, match="unknown worker"):
        r.offer("stranger", 1, 0, 1.0, "d", now=0.0)
    assert r.version == 0 and list(r.pending) == [0]


def test_backup_workers_apply_early_and_drop_the_late_gradient():
    r = rules("sync", 3, backup_workers=1)
    r.offer("w0", 1, 0, 1.0, "a", now=0.0)
    decision = r.offer("w2", 1, 0, 1.0, "c", now=1.0)
    assert decision.outcome is Outcome.APPLIED and [c.rank for c in decision.apply] == [0, 2]
    late = r.offer("w1", 1, 0, 1.0, "b", now=2.0)
    assert late.outcome is Outcome.LATE and late.staleness == 1 and not late.apply
    assert r.counts["dropped_late"] == 1 and r.version == 1


def test_a_worker_done_leaves_the_quorum_and_can_complete_the_step():
    r = rules("sync", 2)
    r.offer("w0", 1, 0, 1.0, "a", now=0.0)
    decision = r.mark_done("w1", now=2.0)
    assert decision.apply and r.version == 1 and not r.all_done()
    assert r.offer("w0", 2, 1, 1.0, "a", now=3.0).outcome is Outcome.APPLIED  # alone now
    r.mark_done("w0", now=4.0)
    assert r.all_done()


def test_duplicates_are_acknowledged_without_change():
    r = rules("async")
    assert r.offer("w0", 1, 0, 1.0, "a", now=0.0).outcome is Outcome.APPLIED
    again = r.offer("w0", 1, 0, 1.0, "a", now=0.0)
    assert again.outcome is Outcome.DUPLICATE and not again.apply and r.version == 1
    assert r.counts["duplicates"] == 1


def test_async_applies_everything_and_records_staleness():
    r = rules("async")
    for step in range(1, 4):
        r.offer("w0", step, r.version, 1.0, "a", now=0.0)
    decision = r.offer("w1", 1, 0, 1.0, "b", now=0.0)
    assert decision.outcome is Outcome.APPLIED and decision.staleness == 3 and r.version == 4
    assert r.staleness_histogram == {0: 3, 3: 1}


def test_ssp_rejects_beyond_the_bound_and_accepts_within():
    r = rules("ssp", staleness_bound=2)
    for step in range(1, 4):
        r.offer("w0", step, r.version, 1.0, "a", now=0.0)
    stale = r.offer("w1", 1, 0, 1.0, "b", now=0.0)
    assert stale.outcome is Outcome.STALE and stale.staleness == 3 and stale.version == 3
    assert r.version == 3 and r.counts["rejected_stale"] == 1
    # the same step, recomputed on a fresh version, is not a duplicate
    assert r.offer("w1", 1, 1, 1.0, "b", now=0.0).outcome is Outcome.APPLIED
    assert r.staleness_histogram == {0: 3, 2: 1}


def test_registration_is_idempotent_and_bounded():
    r = AggregationRules("sync", 2)
    assert r.register("a", requested_rank=1) == 1
    assert r.register("a") == 1
    assert r.register("b") == 0
    with pytest.raises(PushRefused, match="taken"):
        r.register("c")
    with pytest.raises(PushRefused, match="already holds rank"):
        r.register("a", requested_rank=0)


def test_state_round_trip_keeps_versions_and_counters():
    r = rules("ssp", staleness_bound=1)
    r.offer("w0", 1, 0, 8.0, "a", now=0.0)
    restored = AggregationRules("ssp", 2, staleness_bound=1)
    restored.load_state_dict(r.state_dict())
    assert restored.version == 1 and restored.ranks == r.ranks and restored.counts == r.counts
    assert restored.offer("w0", 1, 1, 1.0, "a", now=0.0).outcome is Outcome.DUPLICATE
    with pytest.raises(ValueError, match="mode"):
        AggregationRules("sync", 2).load_state_dict(r.state_dict())


def test_invalid_rules_are_refused():
    with pytest.raises(ValueError):
        AggregationRules("gossip", 2)
    with pytest.raises(ValueError):
        AggregationRules("sync", 2, backup_workers=2)
