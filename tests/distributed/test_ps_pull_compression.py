"""Pull compression on two real shard servers (port 0) with two synchronous workers:
after every step each worker's parameters equal the shards' broadcast copies to the bit,
the copies stay within top-k's bound of the true parameters, a dense version every N
brings everyone to the true parameters, and the parameters received take fewer bytes
than dense ones. The classic and the overlapped step both."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from disttrain.compression import topk_count
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, SyncOptions, WorkerTensors, make_exchange
from disttrain.training.engine import forward_backward
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)

SHARDS, WORKERS, STEPS, DENSE_EVERY, RATIO = 2, 2, 7, 4, 0.05


class Worker:
    """One synchronous worker: its model in flat buffers, its client and exchange."""

    def __init__(self, config, addresses: list[str], rank: int, overlap: bool):
        self.model = init_model(config.training)
        self.plans = plan_shards(self.model, SHARDS)
        self.flat, self.grads = flat_parameters(self.model)
        # Pull compression saves the socket's bytes: shared memory's answers stay dense.
        self.client = PSClient(addresses, self.plans, RetryPolicy(timeout_s=20.0), "grpc")
        self.client.register(f"w{rank}", rank, key=bytes([65 + rank]) * 32)
        self.client.compress_pulls("topk", RATIO)
        self.exchange = make_exchange(self.client, f"w{rank}", WorkerTensors(self.flat, self.grads),
                                      sync=SyncOptions(overlap=self.model if overlap else None))
        self.rank, self.generator = rank, torch.Generator().manual_seed(rank)

    def step(self, step: int):
        inputs = torch.randn(8, 1, 8, 8, generator=self.generator)
        targets = torch.randint(0, 10, (8,), generator=self.generator)

        def compute():
            self.grads.zero_()
            return forward_backward(self.model, inputs, targets)

        return self.exchange.step(compute, Block(step, WORKERS * step + self.rank, 0, 8), StepTimer())


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlapped"])
def test_workers_hold_the_broadcast_copy_exactly_within_the_bound(tmp_path, overlap):
    config = make_config(tmp_path, num_workers=WORKERS).replace(
        compression={"pull": "topk", "pull_ratio": RATIO, "pull_dense_every": DENSE_EVERY})
    servers = [ShardServer(build_state(config, s, SHARDS), "127.0.0.1:0") for s in range(SHARDS)]
    workers = [Worker(config, [s.address for s in servers], r, overlap) for r in range(WORKERS)]
    pool = ThreadPoolExecutor(WORKERS)
    try:
        with ThreadPoolExecutor(WORKERS) as starting:
            list(starting.map(lambda w: w.exchange.start(), workers))
        states = [s.state for s in servers]
        c = [math.sqrt(1 - topk_count(p.numel, RATIO) / p.numel) for p in workers[0].plans]
        for step in range(1, STEPS + 1):
            before = [s.broadcast_copy() for s in states]
            list(pool.map(lambda w, step=step: w.step(step), workers))
            copies = [s.broadcast_copy() for s in states]
            for worker in workers:  # every worker holds the copy, to the bit
                assert torch.equal(worker.flat, torch.cat(copies))
                assert worker.exchange.versions == [step] * SHARDS
            for shard, state in enumerate(states):
                true = state.parameters()
                residual, delta = (true - copies[shard]).norm(), (true - before[shard]).norm()
                assert residual <= c[shard] * delta + 1e-5 * (true.norm() + 1)
                if step % DENSE_EVERY == 0:
                    assert torch.equal(copies[shard], true)
                else:
                    assert residual > 0  # a change that left something out: the test can tell
        for worker in workers:
            client = worker.client
            dense_steps = STEPS // DENSE_EVERY
            dense = sum(p.nbytes for p in worker.plans)
            assert client.bytes_received_dense == (STEPS + 1) * dense
            # the first pull and each dense version go dense; every other answer is a change
            change = sum(ParameterChanges(p, "topk", RATIO).nbytes for p in worker.plans)
            assert client.bytes_received == (dense_steps + 1) * dense + (STEPS - dense_steps) * change
            assert change < dense / 5
    finally:
        pool.shutdown()
        for worker in workers:
            worker.client.close()
        for server in servers:
            server.stop(0)
