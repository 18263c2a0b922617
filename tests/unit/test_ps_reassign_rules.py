"""The pure rules of reassignment, with a fake clock: the coordinator reassigns a worker
failed for longer than `reassign_after`; the shards' barriers stop waiting for it and mark
it away; the others split its blocks between them; it takes back what is left when it
rejoins; and the ledger answers DUPLICATE for a block finished twice."""

from __future__ import annotations

import math

import pytest
import torch

from disttrain.coordinator.membership import Membership
from disttrain.coordinator.reports import NodeProcess
from disttrain.coordinator.supervisor import Managed, Supervisor
from disttrain.core.errors import DistributedError
from disttrain.data import PlannedSampler, ShardedSampler
from disttrain.strategies.ps.server.aggregation import AggregationRules, Outcome, Push
from disttrain.strategies.ps.server.barriers import Barriers
from disttrain.strategies.ps.worker.blocks import block_id, block_indices
from disttrain.strategies.ps.worker.takeover import Away, away_ranks, present_slice, share

TIMEOUT_S, REASSIGN_S = 5.0, 30.0


# -- who takes which block -----------------------------------------------------------------

def test_the_blocks_of_an_away_worker_are_dealt_round_robin_over_those_present():
    assert share(0, [2], 3, 5) == [(2, 0), (2, 2), (2, 4)]
    assert share(1, [2], 3, 5) == [(2, 1), (2, 3)]
    assert share(2, [2], 3, 5) == []  # the away worker takes nothing over


@pytest.mark.parametrize("world_size,away,batches", [(3, [1], 7), (4, [0, 3], 5), (5, [1, 2, 4], 3),
                                                     (2, [0], 1)])
def test_every_block_of_the_away_workers_goes_to_exactly_one_worker_present(world_size, away, batches):
    shares = {rank: share(rank, away, world_size, batches) for rank in range(world_size)}
    taken = [pair for pairs in shares.values() for pair in pairs]
    assert sorted(taken) == [(owner, index) for owner in away for index in range(batches)]
    sizes = [len(shares[r]) for r in range(world_size) if r not in away]
    assert max(sizes) - min(sizes) <= 1  # spread evenly
    assert all(not shares[r] for r in away)


@pytest.mark.parametrize("planned", [False, True])
def test_a_taken_over_block_holds_the_samples_its_owner_would_have_trained_on(planned):
    def sampler(rank):
        if planned:
            return PlannedSampler(300, world_size=3, rank=rank, seed=4, shares=(40, 16, 8))
        return ShardedSampler(300, world_size=3, rank=rank, seed=4)

    for epoch, index in [(0, 0), (1, 1), (2, 0)]:
        owners = block_indices(sampler(2), 16, epoch, index)
        assert torch.equal(block_indices(sampler(0), 16, epoch, index, rank=2), owners)
        assert len(owners) == (8 if planned else 16)
        assert not set(owners.tolist()) & set(block_indices(sampler(0), 16, epoch, index).tolist())


def test_nobody_left_or_a_rank_outside_the_run_is_refused():
    with pytest.raises(ValueError, match="nobody is left"):
        share(0, [0, 1], 2, 4)
    with pytest.raises(ValueError):
        share(0, [3], 3, 4)


def test_the_evaluation_is_split_among_those_present():
    assert present_slice(0, [1], 3) == (0, 2)
    assert present_slice(2, [1], 3) == (1, 2)
    assert present_slice(1, [1], 3) is None
    assert present_slice(1, [], 3) == (1, 3)


# -- barriers: an away worker is not waited for, and its row says so ----------------------------

def test_a_barrier_does_not_wait_for_a_reassigned_rank_and_marks_it_away():
    barriers = Barriers(3)
    barriers.arrive("epoch0:trained", 0, [1.0])
    barriers.arrive("epoch0:trained", 1, [1.0])
    assert barriers.result("epoch0:trained") is None  # rank 2 failed, not reassigned yet: waited for
    barriers.excuse({2})  # reassigned: the pending barrier completes without it
    rows = barriers.result("epoch0:trained")
    assert rows[:2] == [[1.0], [1.0]] and all(math.isnan(v) for v in rows[2])
    assert away_ranks(rows) == [2]
    barriers.arrive("epoch1:trained", 1, [1.0])
    assert barriers.result("epoch1:trained") is None  # rank 0 is still waited for
    barriers.arrive("epoch1:trained", 0, [1.0])
    assert away_ranks(barriers.result("epoch1:trained")) == [2]
    barriers.excuse(set())  # it rejoined: waited for again
    barriers.arrive("finished", 0, [3.0])
    barriers.arrive("finished", 1, [4.0])
    assert barriers.result("finished") is None
    barriers.arrive("finished", 2, [5.0])
    assert barriers.result("finished") == [[3.0], [4.0], [5.0]]


def test_a_check_of_a_step_is_not_completed_by_an_excused_rank():
    barriers = Barriers(2)
    barriers.excuse({1})
    barriers.arrive("speeds@8", 0, [1.0], step=8, last_steps={0: 8, 1: 3})
    assert barriers.result("speeds@8") == []  # given up as for any rank behind, not answered with NaN


# -- the shard's rules: a reassigned worker counts as done; one block, one application -----------

def sync_rules() -> AggregationRules:
    rules = AggregationRules("sync", 3)
    for rank in range(3):
        rules.register(f"w{rank}", rank)
    rules.set_membership(1, {"w0": 1, "w1": 1, "w2": 1}, now=0.0)
    return rules


def test_a_reassigned_worker_counts_as_done_until_it_rejoins():
    rules = sync_rules()
    rules.set_membership(2, {"w0": 1, "w1": 1}, now=1.0)  # w2 failed
    rules.mark_done("w0", now=2.0)
    rules.mark_done("w1", now=2.0)
    assert not rules.all_done() and rules.status()["num_done"] == 2  # it may still come back
    rules.set_membership(3, {"w0": 1, "w1": 1}, now=31.0, away=frozenset({"w2"}))
    assert rules.all_done() and rules.status()["num_done"] == 3
    rules.set_membership(4, {"w0": 1, "w1": 1, "w2": 4}, now=32.0, away=frozenset({"w2"}))  # rejoined
    assert not rules.all_done() and rules.roster.reassigned == set()


def test_the_lowest_rank_not_reassigned_ends_the_run_and_stops_the_shards():
    rules = sync_rules()
    assert rules.finisher() == 0
    rules.set_membership(2, {"w1": 1, "w2": 1}, now=31.0, away=frozenset({"w0"}))  # worker 0 reassigned
    assert rules.finisher() == 1
    rules.set_membership(3, {"w0": 3, "w1": 1, "w2": 1}, now=32.0, away=frozenset({"w0"}))  # it rejoined
    assert rules.finisher() == 0


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_block_taken_over_then_finished_by_its_owner_is_answered_duplicate(mode):
    rules = AggregationRules(mode, 3, staleness_bound=1)
    for rank in range(3):
        rules.register(f"w{rank}", rank)
    block = block_id(epoch=0, rank=2, index=5, world_size=3, batches_per_epoch=10)
    # w0 takes over w2's block: a redo, applied on arrival in every mode
    taken = rules.offer(Push("w0", 4, rules.version, 32.0, block, 0, redo=True), "gradient", now=1.0)
    assert taken.outcome is Outcome.APPLIED and block in rules.ledger
    samples = rules.counts["samples"]
    # w2 rejoined and pushes the same block as a step of its own: not applied again
    late = rules.offer(Push("w2", 6, rules.version, 32.0, block, 0), "gradient", now=2.0)
    assert late.outcome is Outcome.DUPLICATE
    assert rules.counts["samples"] == samples and rules.ledger.samples_duplicate == 32
    # and a second survivor's redo of it too
    again = rules.offer(Push("w1", 4, rules.version, 32.0, block, 0, redo=True), "gradient", now=3.0)
    assert again.outcome is Outcome.DUPLICATE and rules.counts["applied"] == 1


def test_the_owner_finishing_first_makes_a_survivors_redo_a_duplicate():
    rules = AggregationRules("async", 2)
    rules.register("w0", 0)
    rules.register("w1", 1)
    block = block_id(epoch=1, rank=1, index=2, world_size=2, batches_per_epoch=4)
    assert rules.offer(Push("w1", 7, 0, 16.0, block, 1), "g", now=0.0).outcome is Outcome.APPLIED
    redo = rules.offer(Push("w0", 3, rules.version, 16.0, block, 1, redo=True), "g", now=1.0)
    assert redo.outcome is Outcome.DUPLICATE and rules.counts["applied"] == 1


# -- the coordinator: reassignment after the delay, and the rejoin ------------------------------

def test_a_failed_worker_is_reassigned_exactly_after_the_delay_and_may_rejoin():
    membership = Membership(TIMEOUT_S, reassign_after_s=REASSIGN_S)
    membership.register("worker-0", "worker", now=0.0, process=NodeProcess(1))
    membership.register("worker-2", "worker", now=0.0, process=NodeProcess(3))
    membership.register("server-0", "server", now=0.0, process=NodeProcess(9))
    membership.exited("worker-2", -9, "killed by SIGKILL", now=10.0)
    membership.exited("server-0", -9, "killed by SIGKILL", now=10.0)
    membership.heartbeat("worker-0", now=39.0, pid=1)  # a survivor, heard within the timeout
    generation = membership.generation
    assert membership.check(now=10.0 + REASSIGN_S - 0.01) == []
    events = membership.check(now=10.0 + REASSIGN_S)
    assert [(e.node_id, e.kind) for e in events] == [("worker-2", "reassigned")]
    assert membership.get("worker-2").state == "reassigned" and membership.generation == generation + 1
    assert membership.get("server-0").state == "failed"  # only parameter-server workers are reassigned
    membership.heartbeat("worker-0", now=99.0, pid=1)
    assert membership.check(now=100.0) == []  # once
    assert membership.heartbeat("worker-2", now=100.0, pid=3) is False  # its old process must exit
    node = membership.register("worker-2", "worker", now=101.0, process=NodeProcess(4))  # a restart rejoins
    assert node.state == "alive" and node.restarts == 1 and node.recovering


def test_without_a_delay_a_failed_worker_is_never_reassigned():
    membership = Membership(TIMEOUT_S)
    membership.register("worker-1", "worker", now=0.0, process=NodeProcess(1))
    membership.exited("worker-1", 1, "exited with code 1", now=1.0)
    assert membership.check(now=1e6) == [] and membership.get("worker-1").state == "failed"
    with pytest.raises(ValueError):
        Membership(TIMEOUT_S, reassign_after_s=0.0)


def test_the_worker_sees_its_owner_back_only_after_seeing_it_reassigned():
    away = Away()
    away.update(3, {"worker0": 1, "worker1": 1, "worker2": 1}, {})  # a membership from before the failure
    assert not away.is_back(2)  # behind the shards: not a reason to leave its blocks alone
    away.update(5, {"worker0": 1, "worker1": 1}, {"worker2": 2})
    assert not away.is_back(2)
    away.update(6, {"worker0": 1, "worker1": 1, "worker2": 6}, {})
    assert away.is_back(2)
    away.update(9, {"worker0": 1, "worker1": 1}, {"worker2": 2})  # failed and reassigned again
    assert not away.is_back(2)


# -- the supervisor: the run goes on without an expendable worker past its restarts ----------------

class FakeCluster:
    """Spawns nothing: the supervisor's bookkeeping is what is tested."""

    def __init__(self):
        self.spawned: list[str] = []
        self.children: dict = {}

    def spawn(self, name, spec):
        self.spawned.append(name)
        self.children[name] = Silent()


class Silent:
    """A child that reported no progress and no error."""

    furthest = error = None
    log_path = "silent.log"

    def tail(self, lines):
        return ""


def test_an_expendable_worker_past_its_restarts_is_left_out_and_another_process_stops_the_run():
    cluster = FakeCluster()
    supervisor = Supervisor(cluster, max_restarts=0)
    supervisor.start(Managed("worker2", "worker2", lambda attempt: None, expendable=True))
    supervisor.start(Managed("server0", "server0", lambda attempt: None))
    assert supervisor.exited("worker2", -9) is False
    assert supervisor.processes["worker2"].given_up and cluster.spawned == ["worker2", "server0"]
    assert [f.name for f in supervisor.failures] == ["worker2"]

    class Child(Silent):
        log_path = "server0.log"

        def tail(self, lines):
            return "killed"

    cluster.children["server0"] = Child()
    with pytest.raises(DistributedError, match="max_restarts=0"):
        supervisor.exited("server0", -9)
