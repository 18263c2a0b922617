"""Shards of a sync run reach one step again by themselves, whatever the interleaving of
server restores and worker restarts: each test drives real shard servers (2 shards) and
workers' exchanges by hand into one interleaving that once left the workers waiting for
a step no shard would reach, and checks the servers' steps and ledgers after.

- Another worker's redo moved a shard's version on within a step: a worker's push of
  that step, computed on the version before the redo, joins the step (it was dropped as
  late, and its worker waited for a step that needed its own push).
- A worker restarted after a shard came back from an older checkpoint: the shard's own
  answer says it was restored, so the new worker computes on what it came back with (it
  waited for steps the shard had lost, which no wait brings back).
- A worker that finds a shard restored by a pull (not by a push of its own) learns it
  from the shard's answer too.
"""

from __future__ import annotations

import threading

import pytest
import torch

from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import (
    Block,
    ExchangeRules,
    SyncOptions,
    WorkerTensors,
    make_exchange,
)
from disttrain.training.engine import StepResult
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(90)

torch.set_num_threads(1)
SHARDS = 2
AGREE_S = 3.0  # how long a worker lets its shards disagree; a deadlock fails within it


def start_servers(config):
    return [ShardServer(build_state(config, s, SHARDS), "127.0.0.1:0") for s in range(SHARDS)]


def restart_server(config, servers, shard):
    """A crash of `shard`'s server (no final checkpoint) and its restart from its newest one."""
    servers[shard].state.flush_checkpoints()
    address = servers[shard].address
    servers[shard]._server.stop(0)
    servers[shard] = ShardServer(build_state(config, shard, SHARDS, resume=True), address)


def exchange_for(config, servers, worker_id, generation=0):
    plans = plan_shards(init_model(config.training), SHARDS)
    client = PSClient([s.address for s in servers], plans, RetryPolicy(timeout_s=8.0, max_attempts=2))
    client.register(worker_id, int(worker_id[1:]), generation, key=worker_id.encode() * 16)
    flat = torch.zeros(sum(p.numel for p in plans))
    exchange = make_exchange(client, worker_id, WorkerTensors(flat, torch.ones_like(flat)),
                             ExchangeRules("sync", generation=generation),
                             sync=SyncOptions(agree_timeout_s=AGREE_S))
    exchange.start()
    return exchange


def result():
    return StepResult(0.0, 0, 8)


def block_of(exchange, step):
    return 100 * int(exchange.worker_id[1:]) + step


def step_together(exchanges, step, epoch=0):
    """Every exchange takes `step` (of `epoch`) at once (one thread each); their errors, if any."""
    errors: list[BaseException] = []

    def take(exchange):
        try:
            exchange.step(result, Block(step, block_of(exchange, step), epoch, 8), StepTimer())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=take, args=(e,), daemon=True) for e in exchanges]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def stop(servers, exchanges):
    for exchange in exchanges:
        exchange.client.close()
    for server in servers:
        server.stop(0)


def steps_of(servers):
    return [s.state.rules.sync_step for s in servers]


def test_a_push_computed_before_another_workers_redo_joins_its_step(tmp_path):
    config = make_config(tmp_path, num_workers=2)
    servers = start_servers(config)
    w0, w1 = exchange_for(config, servers, "w0"), exchange_for(config, servers, "w1")
    try:
        assert step_together([w0, w1], 1) == []
        # At an epoch's end w1 redoes a block shard 1 lost (applied on arrival: shard 1's
        # version moves on, its step does not); w0, done with its own redos, holds the
        # version before.
        w1.redo(result, Block(1, 150, 0, 8, redo=True), [1], StepTimer())
        assert [s.state.version for s in servers] == [1, 2] and steps_of(servers) == [1, 1]
        assert w0.versions == [1, 1] and w1.versions == [1, 2]
        # The next step: w0's push to shard 1 is of step 1's parameters, as w1's is. It
        # joins step 2 there; dropped as late, w0 waited for shard 1 to apply step 2,
        # which waited for w0's push.
        assert step_together([w0, w1], 2) == []
        assert steps_of(servers) == [2, 2] and w0.sync_steps() == w1.sync_steps() == [2, 2]
        assert [s.state.ledger(0, 0) for s in servers] == [[1, 2, 101, 102], [1, 2, 101, 102, 150]]
        assert torch.equal(w0.flat, w1.flat)
    finally:
        stop(servers, [w0, w1])


def test_a_worker_restarted_after_a_shard_restore_computes_on_what_it_came_back_with(tmp_path):
    config = make_config(tmp_path, num_workers=1).replace(training={"checkpoint_interval": 3})
    servers = start_servers(config)
    w0 = exchange_for(config, servers, "w0")
    restarted = None
    try:
        for step in range(1, 6):
            w0.step(result, Block(step, step, 0, 8), StepTimer())
        # Shard 1 comes back from its checkpoint of step 3, two steps behind shard 0, and
        # the worker restarts before its next push: nothing it remembers says shard 1 was
        # restored.
        restart_server(config, servers, 1)
        w0.client.close()
        restarted = exchange_for(config, servers, "w0")
        assert restarted.sync_steps() == [5, 3]
        # Its step computes on what shard 1 came back with (no wait brings back the steps
        # it lost: a stand-in moved it one step and the worker then waited for good), and
        # shard 1 counts on from shard 0's step.
        restarted.step(result, Block(6, 6, 0, 8), StepTimer())
        assert restarted.trained_on == (3, 5)
        assert steps_of(servers) == [6, 6] and restarted.sync_steps() == [6, 6]
        restarted.step(result, Block(7, 7, 0, 8), StepTimer())
        assert restarted.trained_on == (6, 6) and steps_of(servers) == [7, 7]
        assert servers[1].state.ledger(0, 0) == [1, 2, 3, 6, 7]  # 4 and 5 are redone at the epoch's end
    finally:
        stop(servers, [w0] + ([restarted] if restarted else []))


def test_a_worker_that_finds_a_shard_restored_by_a_pull_goes_on(tmp_path):
    config = make_config(tmp_path, num_workers=1).replace(training={"checkpoint_interval": 3})
    servers = start_servers(config)
    w0 = exchange_for(config, servers, "w0")
    try:
        for step in range(1, 6):
            w0.step(result, Block(step, step, 0, 8), StepTimer())
        # Shard 1 is restored from its checkpoint of step 3 just as the worker pulls every
        # shard to redo a block (after which it holds every shard at one step again): the
        # worker learns of the restore from the pull's answer, not from a push of its own.
        pull, crashed = w0.client.pull, []

        def pull_across_a_restart(worker_id, flat, versions, shards=None, policy=None):
            if not crashed:
                crashed.append(True)
                restart_server(config, servers, 1)
            return pull(worker_id, flat, versions, shards, policy)

        w0.client.pull = pull_across_a_restart
        w0.redo(result, Block(5, 4, 0, 8, redo=True), [0], StepTimer())
        assert crashed and w0.sync_steps() == [5, 3]
        w0.step(result, Block(6, 6, 0, 8), StepTimer())
        assert w0.trained_on == (3, 5) and steps_of(servers) == [6, 6]
    finally:
        stop(servers, [w0])


def test_a_restored_shard_holds_a_restarted_workers_push_over_for_the_step_after(tmp_path):
    config = make_config(tmp_path, num_workers=2).replace(training={"checkpoint_interval": 3})
    servers = start_servers(config)
    w0, w1 = exchange_for(config, servers, "w0"), exchange_for(config, servers, "w1")
    restarted = None
    try:
        for step in range(1, 5):
            assert step_together([w0, w1], step) == []
        # w1's push of step 5 reaches shard 0 only: it dies; shard 1 comes back from its
        # checkpoint of step 3 (restored), and w0's step 5 completes on shard 0.
        w1.from_step = 4  # as its step 5 names it
        w1.prepare(Block(5, 105, 0, 8), [0], StepTimer())()
        restart_server(config, servers, 1)
        first = threading.Thread(target=step_together, args=([w0], 5), daemon=True)
        first.start()
        rules = servers[0].state.rules
        with servers[0].state._changed:
            assert servers[0].state._changed.wait_for(lambda: rules.sync_step == 5, 30)
        # w1 restarts from its checkpoint of step 3 and takes up step 4: its push is
        # computed on step 5 (shard 0's), w0's to shard 1 on step 4. Put into one step,
        # shard 1 counted it as step 6, a step apart from shard 0 for w0, which then
        # waited for shard 0 to reach a step that waited for w0's own next push.
        w1.client.close()
        restarted = exchange_for(config, servers, "w1")
        second = threading.Thread(target=step_together, args=([restarted], 4), daemon=True)
        second.start()
        first.join(30)
        assert not first.is_alive() and w0.sync_steps() == [5, 5] and w0.trained_on == (3, 5)
        assert step_together([w0], 6) == []
        second.join(30)
        assert not second.is_alive() and restarted.sync_steps() == w0.sync_steps() == [6, 6]
        assert steps_of(servers) == [6, 6]
        assert [s.state.ledger(0, 0) for s in servers] == [
            [1, 2, 3, 4, 5, 6, 101, 102, 103, 104, 105], [1, 2, 3, 5, 6, 101, 102, 103, 104]]
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


def test_a_shard_restored_after_a_worker_finished_its_epoch_learns_it_while_that_worker_waits(tmp_path):
    config = make_config(tmp_path, num_workers=2).replace(training={"checkpoint_interval": 3,
                                                                    "num_epochs": 2})
    servers = start_servers(config)

    def membership(generation, live):  # as the coordinator tells every shard
        for server in servers:
            server.state.set_membership(generation, live)

    w0, w1 = (exchange_for(config, servers, f"w{rank}", generation=1) for rank in (0, 1))
    restarted = None
    try:
        membership(1, {"w0": 1, "w1": 1})
        for step in (1, 2):
            assert step_together([w0, w1], step) == []
        membership(2, {"w0": 1})  # w1 dies; w0 trains epoch 0 to its end alone
        w0.step(result, Block(3, 3, 0, 8), StepTimer())
        w0.step(result, Block(4, 4, 0, 8, last_in_epoch=True), StepTimer())
        # Shard 1 comes back from its checkpoint of step 3: it lost that w0 finished
        # epoch 0. w0 waits at the epoch's barrier (on shard 0) for w1, which restarted
        # and trains epoch 0's last steps: on shard 1 they waited for w0 for good.
        restart_server(config, servers, 1)
        membership(3, {"w0": 1, "w1": 3})
        w0.client.finished_epochs(1)  # as its epoch's end says
        waiting = []
        barrier = threading.Thread(
            target=lambda: waiting.append(w0.client.barrier("w0", "epoch0:trained", [1.0])), daemon=True)
        barrier.start()
        w1.client.close()
        restarted = exchange_for(config, servers, "w1", generation=3)
        assert step_together([restarted], 3) == []  # w0, at the barrier, told shard 1 it is done with epoch 0
        assert steps_of(servers) == [5, 5] and restarted.sync_steps() == [5, 5]
        assert servers[1].state.rules.roster.parked[0] == 0
        restarted.client.finished_epochs(1)
        assert restarted.client.barrier("w1", "epoch0:trained", [1.0]) == [[1.0], [1.0]]
        barrier.join(30)
        assert waiting == [[[1.0], [1.0]]]
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


@pytest.mark.parametrize("checkpoint", [True, False], ids=["from-its-checkpoint", "before-its-first"])
def test_a_barrier_wait_that_spans_two_restarts_of_its_shard_goes_on(tmp_path, checkpoint):
    config = make_config(tmp_path, num_workers=2)
    servers = [ShardServer(build_state(config, 0, 1), "127.0.0.1:0")]
    plans = plan_shards(init_model(config.training), 1)
    clients = [PSClient([servers[0].address], plans, RetryPolicy(timeout_s=8.0, max_attempts=5))
               for _ in range(2)]
    try:
        for rank, client in enumerate(clients):
            client.register(f"w{rank}", rank, key=f"w{rank}".encode() * 16)
        if checkpoint:  # a barrier once met is kept: the shard writes a checkpoint
            threads = [threading.Thread(target=c.barrier, args=(f"w{r}", "start"), daemon=True)
                       for r, c in enumerate(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            servers[0].state.flush_checkpoints()

        def arrived():  # w0 waits at the barrier on the shard's current server
            state = servers[0].state
            with state._changed:
                assert state._changed.wait_for(
                    lambda: 0 in state.barriers._arrived.get("epoch0:trained", {}), 30)

        waiting = []
        barrier = threading.Thread(
            target=lambda: waiting.append(clients[0].barrier("w0", "epoch0:trained", [1.0])), daemon=True)
        barrier.start()
        # The shard is killed twice before its next checkpoint while w0 waits: each time w0
        # registers anew and waits on (after the second, it stopped, its call refused: for
        # its session, or for an unknown worker by a shard that came back from nothing).
        for _ in range(2):
            arrived()
            address = servers[0].address
            servers[0]._server.stop(0)
            servers[0] = ShardServer(build_state(config, 0, 1, resume=True), address)
        arrived()
        assert clients[1].barrier("w1", "epoch0:trained", [2.0]) == [[1.0], [2.0]]
        barrier.join(30)
        assert waiting == [[[1.0], [2.0]]]
    finally:
        for client in clients:
            client.close()
        servers[0].stop(0)


def test_a_worker_whose_step_went_on_without_it_everywhere_starts_it_again_from_the_shards_step(tmp_path):
    config = make_config(tmp_path, num_workers=2).replace(training={"checkpoint_interval": 3,
                                                                    "num_epochs": 2})
    servers = start_servers(config)
    w0, w1 = (exchange_for(config, servers, f"w{rank}") for rank in (0, 1))
    restarted = None
    try:
        assert step_together([w0, w1], 1) == []
        threads = [threading.Thread(target=e.step, args=(result, b, StepTimer()), daemon=True)
                   for e, b in ((w0, Block(2, 2, 0, 8, last_in_epoch=True)), (w1, Block(2, 102, 0, 8)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        # w1 restarts from the beginning and catches up alone: w0 finished epoch 0, so its
        # steps there go on without w0 (checkpoints at step 3), and w0 holds step 2.
        w1.client.close()
        restarted = exchange_for(config, servers, "w1")
        restarted.step(result, Block(1, 101, 0, 8), StepTimer())
        restarted.step(result, Block(2, 102, 0, 8, last_in_epoch=True), StepTimer())
        assert steps_of(servers) == [4, 4] and w0.sync_steps() == [2, 2]
        # Shard 1 comes back from step 3. w0's push of its next step is late on shard 0
        # and turned back on shard 1: named by the step w0 held (2), shard 1 took it for a
        # step of its own, a step apart from shard 0 for w0, which then waited for good.
        restart_server(config, servers, 1)
        assert step_together([w0, restarted], 3, epoch=1) == []
        assert steps_of(servers) == [5, 5] and w0.sync_steps() == restarted.sync_steps() == [5, 5]
        assert all(3 in s.state.ledger(0, 0) and 103 in s.state.ledger(0, 0) for s in servers)
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


def test_a_worker_that_is_done_stays_done_on_a_shard_restored_after_it_left(tmp_path):
    # Found by disttrain chaos, ps-local seed 91: worker 1 finished and exited; shard 1 was
    # killed then and came back from its checkpoint of before worker 1's end, so it refused
    # the final Shutdown ("workers are still training") for a worker that was gone.
    config = make_config(tmp_path, num_workers=2).replace(training={"checkpoint_interval": 2})
    servers = start_servers(config)
    w0, w1 = (exchange_for(config, servers, f"w{rank}") for rank in (0, 1))
    try:
        for step in (1, 2, 3):  # shard checkpoints at version 2; version 3 is in none of them
            assert step_together([w0, w1], step) == []
        w1.client.worker_done("w1")  # answered: the mark is in a checkpoint on every shard
        w1.client.close()
        restart_server(config, servers, 1)
        assert servers[1].state.rules.done == {1}
        assert steps_of(servers) == [3, 3]
        w0.client.worker_done("w0")  # re-registers with the restarted shard as it does
        for server in servers:
            assert server.state.rules.all_done()
    finally:
        stop(servers, [w0, w1])
