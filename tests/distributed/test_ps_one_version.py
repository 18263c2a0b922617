"""One step across shards on real shard servers (2 shards, sync mode): a worker never
holds parameters of different steps when it computes. A restarted worker whose first
pull finds one shard a step ahead waits for the other; a shard that cannot get there
fails the step within the deadline; a shard restored from an older checkpoint counts on
from the others' step, and the steps agree again after one step. Each test checks what
the worker holds against the servers' own parameters and steps."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from disttrain.metrics.window import StepTimer
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.agreement import StepsDisagree
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, SyncOptions, WorkerTensors, make_exchange
from disttrain.training.engine import StepResult
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(90)

torch.set_num_threads(1)
SHARDS = 2
Outcome = pb.PushReply.Outcome


def start_servers(config):
    return [ShardServer(build_state(config, s, SHARDS), "127.0.0.1:0") for s in range(SHARDS)]


def exchange_for(config, servers, worker_id, agree_timeout_s=20.0, start=True):
    plans = plan_shards(init_model(config.training), SHARDS)
    client = PSClient([s.address for s in servers], plans, RetryPolicy(timeout_s=10.0, max_attempts=3))
    client.register(worker_id, int(worker_id[1:]), key=worker_id.encode() * 16)
    flat = torch.zeros(sum(p.numel for p in plans))
    exchange = make_exchange(client, worker_id, WorkerTensors(flat, torch.ones_like(flat)),
                             sync=SyncOptions(agree_timeout_s=agree_timeout_s))
    if start:
        exchange.start()
    return exchange


def push_to(exchange, shards, step, block):
    """`exchange`'s worker pushes its gradient of `step` to `shards` only (its push to the
    others is held up), without waiting for the step."""
    return exchange.prepare(Block(step, block, 0, 8), shards, StepTimer())()


def servers_flat(servers):
    return torch.cat([s.state.broadcast_copy() for s in servers])


def result():
    return StepResult(0.0, 0, 8)


def stop(servers, exchanges):
    for exchange in exchanges:
        exchange.client.close()
    for server in servers:
        server.stop(0)


class Computed(Exception):
    """Ends a step once its gradient was computed (what it was computed on is the point)."""


def computed_on(exchange):
    """A gradient computation that notes the steps and parameters it ran on, then ends the step."""
    seen = []

    def compute():
        seen.append((exchange.sync_steps(), exchange.flat.clone()))
        raise Computed

    return compute, seen


def test_a_restarted_worker_whose_shards_are_a_step_apart_waits_for_the_one_behind(tmp_path):
    config = make_config(tmp_path, num_workers=2)
    servers = start_servers(config)
    w0, w1 = exchange_for(config, servers, "w0"), exchange_for(config, servers, "w1")
    restarted = None
    try:
        # Step 1: w1's push reaches both shards; w0's reaches shard 0 only (cut off from
        # shard 1), so shard 0 applies step 1 and shard 1 still waits for w0.
        assert [r.outcome for r in push_to(w1, [0, 1], 1, 101)] == [Outcome.Value("BUFFERED")] * 2
        assert push_to(w0, [0], 1, 1)[0].outcome == Outcome.Value("APPLIED")
        assert [s.state.rules.sync_step for s in servers] == [1, 0]

        # w1 restarts now (from its checkpoint of step 1). Its first pull finds shard 0 at
        # step 1 and shard 1 at step 0: a model that never existed.
        restarted = exchange_for(config, servers, "w1")
        assert restarted.sync_steps() == [1, 0] and restarted.versions == [1, 0]

        # Its step 2 does not compute on them: it waits for shard 1 (its own push of step 1
        # is there already), and w0's push gets through as the wait begins.
        pull, late = restarted.client.pull, []

        def pull_then_reconnect(worker_id, flat, versions, shards=None, policy=None):
            if shards == [1] and not late:
                late.append(threading.Thread(target=push_to, args=(w0, [1], 1, 1)))
                late[0].start()
            return pull(worker_id, flat, versions, shards, policy)

        restarted.client.pull = pull_then_reconnect
        compute, seen = computed_on(restarted)
        with pytest.raises(Computed):
            restarted.step(compute, Block(2, 102, 0, 8), StepTimer())
        late[0].join(30)
        assert restarted.agreement.num_waits == 1 and restarted.trained_on == (1, 1)
        ((steps, flat),) = seen
        assert steps == [1, 1] and torch.equal(flat, servers_flat(servers))
        # both shards applied step 1 with both blocks: the stand-in changed nothing
        assert [s.state.ledger(0, 0) for s in servers] == [[1, 101], [1, 101]]
        assert [s.state.rules.sync_step for s in servers] == [1, 1]
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


def test_a_restarted_worker_stands_in_for_the_step_a_shard_waits_for_it_in(tmp_path):
    config = make_config(tmp_path, num_workers=2)
    servers = start_servers(config)
    w0, w1 = exchange_for(config, servers, "w0"), exchange_for(config, servers, "w1")
    restarted = None
    try:
        for exchange, block in ((w0, 1), (w1, 101)):  # step 1 on both shards
            threading.Thread(target=push_to, args=(exchange, [0, 1], 1, block), daemon=True).start()
        w0.client.pull("w0", w0.flat, [1, 1])
        w0.versions = w1.versions = [1, 1]
        push_to(w0, [0, 1], 2, 2)
        push_to(w1, [0], 2, 102)  # w1 dies after its push of step 2 to shard 0: shard 1 waits for it
        restarted = exchange_for(config, servers, "w1")
        assert restarted.sync_steps() == [2, 1]
        # Restarted from its checkpoint of step 1, it takes up step 2 again: shard 1 applies
        # step 2 without it, and the gradient is computed on step 2 of both shards.
        compute, seen = computed_on(restarted)
        with pytest.raises(Computed):
            restarted.step(compute, Block(2, 102, 0, 8), StepTimer())
        ((steps, flat),) = seen
        assert steps == [2, 2] and torch.equal(flat, servers_flat(servers))
        # block 102 reached shard 0 only: shard 1 lacks it, as after any lost push (the
        # worker's next push of it goes there; at the epoch's end it would be redone); the
        # stand-in counted no sample and changed nothing on shard 0
        assert [s.state.ledger(0, 0) for s in servers] == [[1, 2, 101, 102], [1, 2, 101]]
        assert [s.state.status()["num_samples_applied"] for s in servers] == [32, 24]
        assert [s.state.rules.sync_step for s in servers] == [2, 2]
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


def test_a_shard_that_stays_a_step_behind_fails_the_step_within_the_deadline(tmp_path):
    config = make_config(tmp_path, num_workers=2)
    servers = start_servers(config)
    w0, w1 = exchange_for(config, servers, "w0"), exchange_for(config, servers, "w1")
    restarted = None
    try:
        push_to(w1, [0, 1], 1, 101)
        push_to(w0, [0], 1, 1)  # w0 is cut off from shard 1 for good
        restarted = exchange_for(config, servers, "w1", agree_timeout_s=1.0)
        compute, seen = computed_on(restarted)
        began = time.monotonic()
        with pytest.raises(StepsDisagree, match=r"shard 0 step 1 .*shard 1 step 0 .*\[1\] stayed behind"):
            restarted.step(compute, Block(2, 102, 0, 8), StepTimer())
        assert 1.0 <= time.monotonic() - began < 30.0
        assert seen == []  # nothing computed on the mix
        assert [s.state.rules.sync_step for s in servers] == [1, 0]
        assert [s.state.ledger(0, 0) for s in servers] == [[1, 101], []]
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


def test_a_shard_restored_from_an_older_checkpoint_counts_on_from_the_others_step(tmp_path):
    config = make_config(tmp_path, num_workers=1).replace(ps={"aggregation_mode": "sync"})
    servers = start_servers(config)
    exchange = exchange_for(config, servers, "w0")
    try:
        for step in range(1, 4):  # steps 1..3; checkpoints at version 2 (interval 2)
            exchange.step(result, Block(step, step, 0, 8), StepTimer())
            assert exchange.trained_on == (step - 1, step - 1)
        servers[1].state.flush_checkpoints()
        address = servers[1].address
        servers[1]._server.stop(0)  # a crash: no final checkpoint
        servers[1] = ShardServer(build_state(config, 1, SHARDS, resume=True), address)
        assert servers[1].state.rules.sync_step == 2

        # Step 4: shard 1 rolled back; its part is computed again on what it came back with
        # (the one step that holds parameters of different steps, by design) ...
        exchange.step(result, Block(4, 4, 0, 8), StepTimer())
        assert exchange.trained_on == (2, 4)
        # ... and it counts that step as the run's step 4, as shard 0 does.
        assert [s.state.rules.sync_step for s in servers] == [4, 4] and exchange.sync_steps() == [4, 4]
        exchange.step(result, Block(5, 5, 0, 8), StepTimer())
        assert exchange.trained_on == (4, 4)
        assert [s.state.rules.sync_step for s in servers] == [5, 5]
        assert torch.equal(exchange.flat, servers_flat(servers))
    finally:
        stop(servers, [exchange])
