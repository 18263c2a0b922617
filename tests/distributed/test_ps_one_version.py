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
from disttrain.strategies.ps.worker.exchange import Block, make_exchange
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
    exchange = make_exchange("sync", client, worker_id, flat, torch.ones_like(flat), 0,
                             agree_timeout_s=agree_timeout_s)
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

        # w1 restarts now. Its first pull finds shard 0 at step 1 and shard 1 at step 0:
        # a model that never existed.
        restarted = exchange_for(config, servers, "w1", start=False)
        mixed = restarted.client.pull("w1", restarted.flat, [0, 0])
        assert restarted.sync_steps() == [1, 0] and mixed == [1, 0]

        # With the agreement it pulls shard 1 again and waits; w0's push to shard 1 gets
        # through as the wait begins, and both shards are at step 1 when it returns.
        pull, late = restarted.client.pull, []

        def pull_then_reconnect(worker_id, flat, versions, shards=None, policy=None):
            if shards == [1] and not late:
                late.append(threading.Thread(target=push_to, args=(w0, [1], 1, 1)))
                late[0].start()
            return pull(worker_id, flat, versions, shards, policy)

        restarted.client.pull = pull_then_reconnect
        restarted.start()
        late[0].join(30)
        assert restarted.agreement.num_waits == 1
        assert restarted.sync_steps() == [1, 1] and restarted.versions == [1, 1]
        assert torch.equal(restarted.flat, servers_flat(servers))
    finally:
        stop(servers, [w0, w1] + ([restarted] if restarted else []))


def test_a_shard_that_stays_a_step_behind_fails_the_worker_within_the_deadline(tmp_path):
    config = make_config(tmp_path, num_workers=2)
    servers = start_servers(config)
    w0, w1 = exchange_for(config, servers, "w0"), exchange_for(config, servers, "w1")
    restarted = None
    try:
        push_to(w0, [0, 1], 1, 1)
        push_to(w1, [0], 1, 101)  # w1 stops after its push to shard 0: shard 1 waits for it
        restarted = exchange_for(config, servers, "w1", agree_timeout_s=1.0, start=False)
        began = time.monotonic()
        with pytest.raises(StepsDisagree, match=r"shard 0 step 1 .*shard 1 step 0 .*\[1\] stayed behind step 1"):
            restarted.start()  # shard 1 waits for this very worker: no wait can end it
        assert 1.0 <= time.monotonic() - began < 30.0
        assert [s.state.rules.sync_step for s in servers] == [1, 0]  # nothing pushed meanwhile
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
