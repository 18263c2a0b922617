"""Recovery pieces of the parameter server on real sockets: a worker the coordinator
declared failed is fenced, a gradient with NaN in one shard's slice reaches no shard, and
a worker notices a shard that restarted from an older checkpoint and redoes what it lost.
Each test checks the servers' state, not logs."""

import grpc
import pytest
import torch

from disttrain.core.errors import TrainingError
from disttrain.metrics.window import StepTimer
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, ExchangeRules, WorkerTensors, make_exchange
from disttrain.training.engine import StepResult
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(60)


def start(config, shards):
    servers = [ShardServer(build_state(config, s, shards), "127.0.0.1:0") for s in range(shards)]
    plans = plan_shards(init_model(config.training), shards)
    return servers, plans


def exchange_for(config, servers, plans, worker_id, mode="async", generation=0):
    client = PSClient([s.address for s in servers], plans, RetryPolicy(timeout_s=10.0, max_attempts=3))
    client.register(worker_id)
    flat = torch.zeros(sum(p.numel for p in plans))
    exchange = make_exchange(client, worker_id, WorkerTensors(flat, torch.ones_like(flat)),
                             ExchangeRules(mode, generation=generation))
    exchange.start()
    return exchange


def result():
    return StepResult(0.0, 0, 8)


def test_a_worker_declared_failed_is_fenced_and_changes_nothing(tmp_path):
    config = make_config(tmp_path, num_workers=2).replace(ps={"aggregation_mode": "async"})
    (server,), plans = start(config, 1)
    try:
        exchanges = [exchange_for(config, [server], plans, f"w{r}", generation=1) for r in range(2)]
        server.state.set_membership(1, {"w0": 1, "w1": 1})
        exchanges[1].step(result, Block(1, 101, 0, 8), StepTimer())
        server.state.set_membership(2, {"w0": 1})  # w1 missed its heartbeats
        before, version = server.state.parameters(), server.state.version
        with pytest.raises(Exception, match="declared failed"):
            exchanges[1].step(result, Block(2, 102, 0, 8), StepTimer())
        assert server.state.version == version and torch.equal(server.state.parameters(), before)
        assert server.state.status()["num_fenced"] == 1
        exchanges[0].step(result, Block(1, 1, 0, 8), StepTimer())  # the others go on
        assert server.state.version == version + 1
    finally:
        server.stop(0)


def test_a_gradient_with_nan_in_one_shards_slice_reaches_no_shard(tmp_path):
    config = make_config(tmp_path, num_workers=1)
    servers, plans = start(config, 2)
    try:
        exchange = exchange_for(config, servers, plans, "w0", mode="sync")
        before = [s.state.parameters() for s in servers]
        exchange.grads[plans[1].offset + 3] = float("nan")  # only shard 1's slice is bad
        with pytest.raises(TrainingError, match="no shard"):
            exchange.step(result, Block(1, 0, 0, 8), StepTimer())
        for server, params in zip(servers, before, strict=True):
            assert server.state.version == 0 and torch.equal(server.state.parameters(), params)
    finally:
        for server in servers:
            server.stop(0)


def test_a_worker_redoes_what_a_restarted_shard_lost(tmp_path):
    config = make_config(tmp_path, num_workers=1).replace(ps={"aggregation_mode": "async"})
    (server,), plans = start(config, 1)
    address = server.address
    exchange = exchange_for(config, [server], plans, "w0")
    for step in range(1, 4):  # versions 1..3; a checkpoint at 2 (interval 2)
        exchange.step(result, Block(step, step, 0, 8), StepTimer())
    server.state.flush_checkpoints()
    server._server.stop(0)  # a crash: no final checkpoint
    server = ShardServer(build_state(config, 0, 1, resume=True), address)
    try:
        assert server.state.version == 2
        # the worker's next push finds a restarted shard: it registers again and pushes again
        exchange.step(result, Block(4, 4, 0, 8), StepTimer())
        assert server.state.ledger(0, 0) == [1, 2, 4]
        missing = set(range(1, 5)) - set(server.state.ledger(0, 0))
        for block in sorted(missing):
            exchange.redo(result, Block(4, block, 0, 8, redo=True), [0], StepTimer())
        assert server.state.ledger(0, 0) == [1, 2, 3, 4] and server.state.version == 4
        again = exchange.client.push([pb.GradientMessage(worker_id="w0", step=5, block_id=3, shard=0,
                                                         num_samples=8, base_version=4)],
                                     exchange.grads, [0])[0]
        assert again.outcome == pb.PushReply.DUPLICATE and server.state.version == 4
    finally:
        exchange.client.close()
        server.stop(0)


def test_a_push_after_the_final_checkpoint_began_is_not_taken(tmp_path):
    config = make_config(tmp_path, num_workers=1).replace(ps={"aggregation_mode": "async"})
    (server,), plans = start(config, 1)
    exchange = exchange_for(config, [server], plans, "w0")
    server.state.stop()
    with pytest.raises(Exception) as raised:
        exchange.client.shards[0].policy = RetryPolicy(timeout_s=2.0, max_attempts=1)
        exchange.step(result, Block(1, 1, 0, 8), StepTimer())
    assert "stopping" in str(raised.value) and server.state.version == 0
    assert isinstance(raised.value.__cause__, grpc.RpcError)
    exchange.client.close()
    server.stop(0)
