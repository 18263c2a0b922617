"""One step across shards, as pure rules: the worker's agreement (which shards to pull
again, until when) with a hand-stepped clock, and the shards' count of the run's steps
(redone blocks do not count, nor make a push of the step late; a shard restored from an
older checkpoint says so until its next step, and counts on from its pushes)."""

import pytest

from disttrain.core.errors import DistributedError
from disttrain.strategies.ps.server.aggregation import AggregationRules, Push
from disttrain.strategies.ps.server.ledger import BlockLayout
from disttrain.strategies.ps.worker.agreement import Agreement, StepsDisagree, lag


def test_shards_at_one_step_need_nothing():
    assert lag([3, 3, 3], [3, 7, 3]).wait_for == {}  # shard 1's versions count redone blocks too


def test_a_shard_behind_is_pulled_at_the_version_that_brings_it_to_the_highest_step():
    behind = lag([5, 4, 3], [5, 9, 3])
    assert behind.target == 5
    assert behind.wait_for == {1: 10, 2: 5}


def test_lag_refuses_lists_that_do_not_pair():
    with pytest.raises(ValueError):
        lag([1, 2], [1])
    with pytest.raises(ValueError):
        lag([], [])


def test_the_wait_is_bounded_from_the_first_disagreement_and_fails_with_the_steps_named():
    agreement = Agreement(deadline_s=2.0)
    assert agreement.check([1, 0], [1, 0], now=10.0).wait_for == {1: 1}
    assert agreement.remaining_s(11.5) == pytest.approx(0.5)
    assert agreement.check([1, 0], [1, 0], now=11.9).wait_for == {1: 1}
    with pytest.raises(StepsDisagree, match=r"shard 1 step 0 \(version 0\).*\[1\] stayed behind step 1") as e:
        agreement.check([1, 0], [1, 0], now=12.0)
    assert isinstance(e.value, DistributedError)  # a supervisor's restart recovers from it
    assert agreement.num_waits == 1


def test_agreement_ends_the_wait_and_a_later_one_gets_the_whole_deadline():
    agreement = Agreement(deadline_s=2.0)
    agreement.check([2, 1], [2, 1], now=0.0)
    assert agreement.check([2, 2], [2, 2], now=1.9).wait_for == {}
    assert agreement.remaining_s(100.0) == 2.0
    assert agreement.check([3, 2], [3, 2], now=100.0).wait_for == {1: 3}
    assert agreement.check([3, 2], [3, 2], now=101.9).wait_for == {1: 3}  # 1.9s into its own wait
    assert agreement.num_waits == 2


def test_a_shard_that_overtakes_the_others_raises_the_target():
    agreement = Agreement(deadline_s=5.0)
    assert agreement.check([4, 3], [4, 3], now=0.0).wait_for == {1: 4}
    assert agreement.check([4, 5], [4, 5], now=1.0).wait_for == {0: 5}


def test_a_shard_answered_as_restored_is_never_waited_for_and_others_still_are():
    agreement = Agreement(deadline_s=1.0)
    assert agreement.check([9, 4, 8], [9, 4, 8], now=0.0, restored=[1]).wait_for == {2: 9}
    # however long it lags, whoever asks: the answer of the shard decides, not a memory
    assert Agreement(deadline_s=1.0).check([400, 200], [400, 200], now=5.0, restored=[1]).wait_for == {}
    # once it applied a step its answers no longer say so, and it is held to the others' step
    assert agreement.check([10, 9], [10, 5], now=0.5).wait_for == {1: 6}


def test_a_shard_restored_above_the_others_still_holds_them_to_its_step():
    # restored from a checkpoint written after its step went through, it raises the target
    assert lag([39, 40], [39, 40], restored=[1]).wait_for == {0: 40}


def test_a_step_ends_once_every_shard_applied_it():
    # every answer came before the step was applied (a redone block moved each version on)
    assert lag([4, 4], [6, 5], floor=5).wait_for == {0: 7, 1: 6}
    assert lag([5, 5], [7, 6], floor=5).wait_for == {}
    assert lag([5, 3], [7, 4], restored=[1], floor=5).wait_for == {}


def test_the_deadline_must_be_positive():
    with pytest.raises(ValueError):
        Agreement(0.0)


def sync_rules(world_size=2):
    rules = AggregationRules("sync", world_size)
    for rank in range(world_size):
        rules.register(f"w{rank}")
    return rules


def push(rules, rank, step, sync_step=0, **fields):
    fields.setdefault("block", 100 * rank + step)
    return rules.offer(Push(f"w{rank}", step, rules.version, 1.0, sync_step=sync_step, **fields), "g", 0.0)


def test_a_shard_counts_its_synchronous_steps_and_not_the_blocks_it_redoes():
    rules = sync_rules()
    for step in (1, 2):
        push(rules, 0, step, step - 1)
        push(rules, 1, step, step - 1)
    assert (rules.version, rules.sync_step) == (2, 2)
    push(rules, 0, 2, block=7, redo=True)  # a block a restart lost, applied on arrival
    assert (rules.version, rules.sync_step) == (3, 2)
    push(rules, 0, 3, 2)
    push(rules, 1, 3, 2)
    assert (rules.version, rules.sync_step) == (4, 3)


def test_a_restored_shard_counts_on_from_the_step_its_pushes_were_computed_on():
    rules = sync_rules()
    push(rules, 0, 1)
    push(rules, 1, 1)
    saved = rules.state_dict()
    restored = sync_rules()
    restored.load_state_dict(saved)
    assert restored.sync_step == 1
    # the other shards went on to step 6 meanwhile: the workers computed on it
    push(restored, 0, 7, sync_step=6)
    push(restored, 1, 7, sync_step=6)
    assert (restored.version, restored.sync_step) == (2, 7)


def test_a_refused_update_takes_the_count_back():
    rules = sync_rules()
    push(rules, 0, 1)
    mark = rules.mark()
    push(rules, 1, 1)
    assert rules.sync_step == 1
    rules.rollback(mark)
    assert (rules.version, rules.sync_step) == (0, 0)


def test_a_stand_in_counts_without_samples_where_a_step_waits_for_its_worker_and_nowhere_else():
    waiting = sync_rules()
    push(waiting, 0, 1)
    decision = push(waiting, 1, 1, stand_in=True, block=-1)
    assert decision.advanced and decision.apply[0].rank == 0 and len(decision.apply) == 1
    assert (waiting.version, waiting.sync_step, waiting.counts["samples"]) == (1, 1, 1)
    assert waiting.ledger.blocks == {1} and waiting.ledger.samples_duplicate == 0

    holding = sync_rules()  # the worker's push of the pending step is here already
    push(holding, 1, 1)
    assert push(holding, 1, 1, stand_in=True, block=-1).outcome.name == "DUPLICATE"
    assert holding.version == 0 and list(holding.pending) == [1]
    push(holding, 0, 1)
    assert holding.ledger.blocks == {1, 101}

    alone = AggregationRules("async", 1)
    alone.register("w0")
    assert push(alone, 0, 1, stand_in=True, block=-1).outcome.name == "DUPLICATE" and alone.version == 0


def test_a_push_of_the_pending_step_joins_it_after_blocks_were_redone_on_the_shard():
    rules = sync_rules()
    push(rules, 0, 1)
    push(rules, 1, 1)
    push(rules, 1, 1, block=150, redo=True)  # another worker's redo: the version moves on, not the step
    assert (rules.version, rules.sync_step, rules.step_version) == (2, 1, 1)
    # w0 computed on version 1, w1 on version 2: both of step 1, both join step 2
    early = rules.offer(Push("w0", 2, 1, 1.0, block=2, sync_step=1), "g", 0.0)
    assert early.outcome.name == "BUFFERED" and early.staleness == 1
    assert push(rules, 1, 2, 1).outcome.name == "APPLIED"
    assert (rules.version, rules.sync_step, rules.step_version) == (3, 2, 3)
    assert rules.ledger.blocks == {1, 101, 150, 2, 102} and rules.counts["dropped_late"] == 0
    # a push of the step before (computed on version 2) is late now
    late = rules.offer(Push("w0", 3, 2, 1.0, block=3, sync_step=1), "g", 0.0)
    assert late.outcome.name == "LATE"


def test_a_restored_shard_says_so_until_it_applies_a_step():
    rules = sync_rules()
    push(rules, 0, 1)
    push(rules, 1, 1)
    assert not rules.restored
    restored = sync_rules()
    restored.load_state_dict(rules.state_dict())
    assert restored.restored and restored.step_version == 1
    push(restored, 0, 2, 1, block=7, redo=True)  # a redone block is no step
    assert restored.restored
    mark = restored.mark()
    push(restored, 0, 5, sync_step=4)
    push(restored, 1, 5, sync_step=4)
    assert not restored.restored and restored.sync_step == 5
    restored.rollback(mark)  # an update refused as non-finite: as it was
    assert restored.restored and restored.sync_step == 1


def test_a_shard_restarted_before_its_first_checkpoint_is_restored_too():
    rules = sync_rules()
    rules.restart()
    assert rules.restored
    alone = AggregationRules("async", 1)
    alone.restart()
    assert not alone.restored  # no step to agree on in async and ssp mode


def restored_at_step(steps):
    rules = sync_rules()
    for step in range(1, steps + 1):
        push(rules, 0, step, step - 1)
        push(rules, 1, step, step - 1)
    restored = sync_rules()
    restored.load_state_dict(rules.state_dict())
    return restored


def test_a_restored_shard_holds_a_push_of_a_later_step_over_for_the_step_after():
    # Restored at step 2, which lost that step 5 went on without w1 (restarted): w0's push
    # is computed on step 4 (its step 5), w1's on step 5 (its replay, a step on elsewhere).
    rules = restored_at_step(2)
    assert push(rules, 1, 3, sync_step=5, block=103).outcome.name == "BUFFERED"
    decision = push(rules, 0, 5, sync_step=4, block=5)
    assert decision.outcome.name == "APPLIED" and [c.rank for c in decision.apply] == [0]
    assert (rules.sync_step, list(rules.pending)) == (5, [1])  # step 5, as on the other shards
    assert rules.ledger.blocks == {1, 2, 101, 102, 5}
    # w0's next push completes step 6 with w1's held one
    assert [c.rank for c in push(rules, 0, 6, sync_step=5, block=6).apply] == [0, 1]
    assert rules.sync_step == 6 and not rules.pending


def test_a_held_over_push_that_completes_the_next_step_alone_is_applied_then():
    rules = restored_at_step(2)
    push(rules, 1, 3, sync_step=5, block=103)
    # w0's push is its last of the epoch: the next step no longer waits for it
    decision = push(rules, 0, 5, sync_step=4, block=5, last_in_epoch=True)
    assert decision.outcome.name == "APPLIED" and rules.sync_step == 5
    follow = rules.next_step(0.0)
    assert follow.advanced and [c.rank for c in follow.apply] == [1] and rules.sync_step == 6
    assert not rules.next_step(0.0).advanced


def test_the_push_that_completes_a_step_it_is_held_over_from_is_answered_as_buffered():
    rules = restored_at_step(2)
    push(rules, 0, 5, sync_step=4, block=5)
    decision = push(rules, 1, 3, sync_step=5, block=103)
    assert decision.outcome.name == "BUFFERED" and decision.advanced
    assert [c.rank for c in decision.apply] == [0]
    assert list(rules.pending) == [1]


def test_a_shard_not_restored_and_one_with_backup_workers_put_every_push_into_the_step():
    rules = sync_rules()
    push(rules, 0, 1, sync_step=0)
    assert [c.rank for c in push(rules, 1, 1, sync_step=1).apply] == [0, 1]
    backup = AggregationRules("sync", 3, backup_workers=1)
    for rank in range(3):
        backup.register(f"w{rank}")
    backup.restart()
    push(backup, 0, 1, sync_step=0)
    decision = push(backup, 1, 1, sync_step=1)  # holds another shard a step on: shards part by design
    assert [c.rank for c in decision.apply] == [0, 1]


def test_a_worker_that_registers_having_finished_an_epoch_is_no_longer_waited_for_in_it():
    # Shard restored from before w0's last push of epoch 0 (which parked it there); w1,
    # restarted, trains epoch 0 alone meanwhile. Its step waited for w0 for good.
    rules = AggregationRules("sync", 2, layout=BlockLayout(2, num_epochs=2))
    for rank in range(2):
        rules.register(f"w{rank}")
    assert push(rules, 1, 3, 2, block=103).outcome.name == "BUFFERED"
    rules.register("w0")
    decision = rules.joined("w0", 1, now=0.0)  # what its registration says
    assert decision.advanced and [c.rank for c in decision.apply] == [1] and rules.sync_step == 3
    assert rules.roster.parked == {0: 0}
    # a count past the run's epochs parks it for the run's last epoch only; none, for none
    rules.joined("w1", 7, now=0.0)
    rules.joined("w0", 0, now=0.0)
    assert rules.roster.parked == {0: 0, 1: 1}


def test_a_shard_restarted_with_no_checkpoint_waits_for_live_workers_it_does_not_know_yet():
    # It knows no worker's rank until each registers again; w1 is live (the coordinator
    # says so) and will push this step once it has. Gone on with w0 alone, the step was a
    # step ahead of the other shards' for w1, which then waited for good.
    rules = AggregationRules("sync", 2)
    rules.restart()
    rules.register("w0")
    rules.set_membership(3, {"w0": 1, "w1": 3}, now=0.0)
    assert rules.roster.unregistered == {"w1"}
    assert push(rules, 0, 5, 4, block=5, generation=1).outcome.name == "BUFFERED"
    rules.register("w1")
    assert not rules.joined("w1", 0, now=0.0).advanced  # known now, its push still to come
    assert push(rules, 1, 5, 4, block=105, generation=3).outcome.name == "APPLIED" and rules.sync_step == 5
    # a worker the coordinator no longer counts is not waited for, registered or not
    rules.set_membership(4, {"w0": 1}, now=0.0)
    assert push(rules, 0, 6, 5, block=6, generation=1).outcome.name == "APPLIED"


def test_a_restored_shard_does_not_wait_for_a_worker_that_says_it_is_a_step_on_already():
    # Restored (again) from step 5: it lost that step 7 went on without w0 (restarted then)
    # and w0's push held over for step 8. w0, blocked on the other shards' step 8 (which
    # waits for w1), cannot push again; w1's push of step 7 waited for it for good.
    rules = restored_at_step(5)
    assert push(rules, 1, 7, sync_step=6, block=107).outcome.name == "BUFFERED"
    rules.register("w0")
    decision = rules.joined("w0", 0, now=0.0, sync_step=7)
    assert decision.advanced and [c.rank for c in decision.apply] == [1] and rules.sync_step == 7
    # not restored any more: its next step waits for every worker again
    assert push(rules, 1, 8, sync_step=7, block=108).outcome.name == "BUFFERED"
    # a worker registering again having pushed nothing yet (restarted) says nothing
    rules.register("w0")
    rules.joined("w0", 0, now=0.0)
    assert 0 not in rules.stepping
