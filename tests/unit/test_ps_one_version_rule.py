"""One step across shards, as pure rules: the worker's agreement (which shards to pull
again, until when) with a hand-stepped clock, and the shards' count of the run's steps
(redone blocks do not count; a shard restored from an older checkpoint counts on from
its pushes)."""

import pytest

from disttrain.core.errors import DistributedError
from disttrain.strategies.ps.server.aggregation import AggregationRules, Push
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


def test_a_restored_shard_is_let_lag_once():
    agreement = Agreement(deadline_s=1.0)
    agreement.forgive([1])
    assert agreement.check([9, 4], [9, 4], now=0.0).wait_for == {}
    assert agreement.check([10, 5], [10, 5], now=0.0).wait_for == {1: 10}  # forgiven once only


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


def test_a_checkpoint_without_the_count_takes_its_completed_steps():
    rules = sync_rules()
    push(rules, 0, 1)
    push(rules, 1, 1)
    saved = rules.state_dict()
    del saved["sync_step"]
    again = sync_rules()
    again.load_state_dict(saved)
    assert again.sync_step == 1


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
