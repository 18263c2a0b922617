"""Aggregation rules with no sockets and a hand-stepped clock."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.strategies.ps.server.aggregation import AggregationRules, Outcome, Push, PushRefused
from disttrain.strategies.ps.server.ledger import Ledger
from disttrain.strategies.ps.server.members import FencedPush, UnknownGeneration


class Rules(AggregationRules):
    """The rules with the positional push form the tests read best in; each (worker,
    step) gets its own data block unless one is given."""

    def offer(self, worker_id, step, base_version, weight, payload, now, **fields):
        fields.setdefault("block", 1000 * int(worker_id[1:]) + step if worker_id[1:].isdigit() else -1)
        return super().offer(Push(worker_id, step, base_version, weight, **fields), payload, now)


def rules(mode, world_size=2, **kwargs):
    r = Rules(mode, world_size, **kwargs)
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


def test_sync_refuses_a_second_gradient_for_the_same_step_and_answers_future_versions():
    r = rules("sync")
    r.offer("w0", 1, 0, 1.0, "a", now=0.0)
    with pytest.raises(PushRefused, match="already pushed"):
        r.offer("w0", 2, 0, 1.0, "b", now=0.0)
    ahead = r.offer("w1", 1, 5, 1.0, "c", now=0.0)  # the shard restarted from an older checkpoint
    assert ahead.outcome is Outcome.ROLLED_BACK and ahead.version == 0 and not ahead.advanced
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


def test_ssp_by_versions_rejects_beyond_the_bound_and_accepts_within():
    r = rules("ssp", staleness_bound=2, ssp_clock="versions")
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
    restored = Rules("ssp", 2, staleness_bound=1)
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


# -- the data ledger, membership and recovery ------------------------------------------


def test_a_block_is_applied_once_whoever_sends_it_and_however_often():
    r = rules("async")
    assert r.offer("w0", 1, 0, 4.0, "a", now=0.0, block=7).advanced
    # a restarted worker registers again and computes block 7 again under a new step number
    r.register("w0")
    again = r.offer("w0", 9, 1, 4.0, "a", now=0.0, block=7)
    assert again.outcome is Outcome.DUPLICATE and not again.apply and r.version == 1
    redo = r.offer("w1", 0, 1, 4.0, "a", now=0.0, block=7, redo=True)
    assert redo.outcome is Outcome.DUPLICATE and r.ledger.blocks == {7}
    assert r.counts["samples"] == 4 and r.ledger.samples_duplicate == 8


def test_a_step_from_far_ahead_is_refused_and_not_recorded():
    r = rules("async")
    r.offer("w0", 1, 0, 4.0, "a", now=0.0)
    before = r.state_dict()
    with pytest.raises(PushRefused, match="ahead of its last step 1"):
        r.offer("w0", 2**62, 1, 4.0, "a", now=0.0)
    assert r.state_dict() == before
    assert r.offer("w0", 1, 1, 4.0, "a", now=0.0).outcome is Outcome.DUPLICATE  # a retry of the last
    assert r.offer("w0", 2, 1, 4.0, "a", now=0.0).outcome is Outcome.APPLIED  # the next step


def test_a_step_answered_without_being_applied_still_counts_as_the_last_one():
    r = rules("ssp", staleness_bound=0, ssp_clock="versions")
    r.offer("w0", 1, 0, 4.0, "a", now=0.0)
    assert r.offer("w1", 1, 0, 4.0, "b", now=0.0).outcome is Outcome.STALE
    assert r.offer("w1", 1, 1, 4.0, "b", now=0.0).outcome is Outcome.APPLIED  # recomputed: the same step
    assert r.offer("w1", 2, 2, 4.0, "c", now=0.0).outcome is Outcome.APPLIED


def test_a_worker_registered_again_may_go_on_from_any_step():
    r = rules("async")
    r.offer("w0", 1, 0, 4.0, "a", now=0.0)
    r.register("w0")  # resumed from a checkpoint ahead of this shard's (restarted from an older one)
    assert r.offer("w0", 40, 1, 4.0, "a", now=0.0).outcome is Outcome.APPLIED
    with pytest.raises(PushRefused, match="ahead"):
        r.offer("w0", 42, 2, 4.0, "a", now=0.0)


def test_sync_counts_a_duplicate_block_as_a_contribution_of_no_samples():
    r = rules("sync", 2)
    r.offer("w0", 1, 0, 1.0, "a", now=0.0, block=1)
    r.offer("w1", 1, 0, 1.0, "b", now=0.0, block=2)
    # worker 1 restarted from an older checkpoint: its step-1 block again, with worker 0's next
    assert r.offer("w0", 2, 1, 3.0, "c", now=1.0, block=3).outcome is Outcome.BUFFERED
    decision = r.offer("w1", 1, 1, 1.0, "b", now=1.0, block=2)
    assert decision.outcome is Outcome.DUPLICATE and decision.advanced and r.version == 2
    assert [(c.rank, c.payload, c.weight) for c in decision.apply] == [(0, "c", 1.0)]
    assert r.ledger.blocks == {1, 2, 3}


def test_a_step_of_no_real_gradient_moves_the_version_and_applies_nothing():
    r = rules("sync", 1)
    r.offer("w0", 1, 0, 1.0, "a", now=0.0, block=1)
    retry = r.offer("w0", 1, 0, 1.0, "a", now=0.0, block=1)  # its reply was lost: nothing changes
    assert retry.outcome is Outcome.DUPLICATE and r.version == 1 and not retry.advanced
    # restarted, the worker computes the block again on the current version: a step of nothing
    decision = r.offer("w0", 1, 1, 1.0, "a", now=0.0, block=1)
    assert decision.outcome is Outcome.DUPLICATE and r.version == 2 and not decision.apply


def test_a_parked_worker_no_longer_holds_up_steps_of_its_epoch():
    r = rules("sync", 2)
    r.offer("w0", 1, 0, 1.0, "a", now=0.0, block=1, epoch=0, last_in_epoch=True)
    assert r.offer("w1", 1, 0, 1.0, "b", now=0.0, block=2, epoch=0).advanced
    # worker 1 fell behind: its remaining blocks of epoch 0 are applied alone
    assert r.offer("w1", 2, 1, 1.0, "c", now=0.0, block=3, epoch=0).outcome is Outcome.APPLIED
    # epoch 1 waits for both again
    assert r.offer("w0", 2, 2, 1.0, "d", now=0.0, block=4, epoch=1).outcome is Outcome.BUFFERED


def test_a_worker_declared_failed_leaves_the_quorum_and_its_late_pushes_are_fenced():
    r = rules("sync", 2)
    r.set_membership(1, {"w0": 1, "w1": 1}, now=0.0)
    r.offer("w0", 1, 0, 1.0, "a", now=0.0, generation=1)
    decision = r.set_membership(2, {"w0": 1}, now=3.0)  # w1 missed its heartbeats
    assert decision.advanced and [c.rank for c in decision.apply] == [0] and r.version == 1
    with pytest.raises(FencedPush, match="declared failed"):
        r.offer("w1", 1, 1, 1.0, "late", now=4.0, generation=1)
    with pytest.raises(UnknownGeneration):
        r.offer("w1", 1, 1, 1.0, "b", now=4.0, generation=3)  # rejoined; news not here yet
    r.set_membership(3, {"w0": 1, "w1": 3}, now=5.0)
    assert r.offer("w1", 1, 1, 1.0, "b", now=5.0, generation=3).outcome is Outcome.BUFFERED
    assert r.version == 1 and r.roster.num_fenced == 1


def test_a_redo_is_applied_on_arrival_in_sync_mode_and_the_ledger_survives_a_restart():
    r = rules("sync", 2)
    decision = r.offer("w0", 0, 0, 2.0, "a", now=0.0, block=5, redo=True)
    assert decision.outcome is Outcome.APPLIED and r.version == 1
    restored = Rules("sync", 2)
    restored.load_state_dict(r.state_dict())
    assert restored.ledger.blocks == {5} and restored.ledger.between(0, 5) == []
    assert restored.offer("w1", 3, 1, 2.0, "a", now=0.0, block=5).outcome is Outcome.DUPLICATE


def test_rollback_forgets_only_the_blocks_added_since_the_mark():
    ledger = Ledger(blocks={1, 2, 3}, samples_duplicate=5)
    duplicate = ledger.mark()
    ledger.add(3)  # already there: stays after the rollback
    ledger.add(4)
    ledger.add(9)
    ledger.samples_duplicate += 64
    ledger.rollback(duplicate)
    assert ledger.blocks == {1, 2, 3} and ledger.samples_duplicate == 5
    ledger.add(4)  # no journal open: nothing to undo later
    assert ledger.state_dict() == {"blocks": [1, 2, 3, 4], "samples_duplicate": 5}


class Counted(Rules):
    """The rules, counting how often a step builds the set of ranks it waits for."""

    built = 0

    def _waiting_for(self, epoch):
        self.built += 1
        return super()._waiting_for(epoch)


class Uncounted(Rules):
    """The rules without the count that spares building the sets: the reference."""

    def _surely_short(self):
        return False


def test_a_step_with_a_membership_builds_its_waiting_set_only_once_enough_pushes_are_in():
    # with a coordinator's membership, each push used to build the set of n ranks: O(n²) a step
    r = Counted("sync", 64)
    for rank in range(64):
        r.register(f"w{rank}")
    r.set_membership(1, {f"w{rank}": 1 for rank in range(64)}, now=0.0)
    r.built = 0
    decisions = [r.offer(f"w{rank}", 1, 0, 1.0, "g", now=0.0, generation=1) for rank in range(64)]
    assert [d.outcome for d in decisions] == [Outcome.BUFFERED] * 63 + [Outcome.APPLIED]
    assert r.built == 1 and r.version == 1


@given(st.integers(2, 6), st.integers(0, 1), st.lists(st.tuples(st.sampled_from(["push", "members", "done"]),
                                                                   st.integers(0, 5), st.booleans()),
                                                         max_size=60))
@settings(max_examples=300, deadline=None)
def test_counting_first_decides_every_push_as_building_the_sets_does(world_size, backup, operations):
    backup = min(backup, world_size - 1)
    fast, reference = Rules("sync", world_size, backup_workers=backup), Uncounted("sync", world_size,
                                                                                 backup_workers=backup)
    ids = [f"w{rank}" for rank in range(world_size)]
    for rules_ in (fast, reference):
        for worker in ids:
            rules_.register(worker)
    steps, generation, joined, now = dict.fromkeys(ids, 1), 0, {}, 0.0

    def both(method, *args, **kwargs):
        results = []
        for rules_ in (fast, reference):
            try:
                d = getattr(rules_, method)(*args, **kwargs)
                results.append((d.outcome, d.version, [c.rank for c in d.apply]))
            except Exception as e:  # a refusal: both must refuse alike
                results.append(type(e).__name__)
        assert results[0] == results[1]
        return results[0]

    for kind, index, flag in operations:
        now += 1.0
        worker = ids[index % world_size]
        if kind == "push":
            step = steps[worker]
            # both at one version (asserted below), so the base version is either's
            result = both("offer", worker, step, fast.version, 1.0, "g", now=now,
                          generation=joined.get(worker, 0), epoch=step // 4,
                          last_in_epoch=flag and step % 4 == 3)
            if not isinstance(result, str):
                steps[worker] += 1
        elif kind == "members":
            generation += 1
            leaving = worker if flag else None
            joined = {w: joined.get(w, generation) for w in ids if w != leaving}
            both("set_membership", generation, dict(joined), now=now)
        else:
            both("mark_done", worker, now=now)
        assert (fast.version, sorted(fast.pending)) == (reference.version, sorted(reference.pending))
