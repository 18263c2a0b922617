"""Pull compression in async and SSP mode on two real shard servers (port 0): a fast and
a slow worker (async: three steps to one; SSP: three steps each in turn; in a fixed
order, so the lags do not depend on timing)
each hold, after every step, the shards' broadcast copies at the versions they hold to
the bit, so within top-k's sync bound of the shards' parameters at those versions; each
answer carries exactly the changes its worker missed (or the copy dense, past the kept
changes or across a dense version), so the bytes received are predicted exactly and are
far fewer than dense; a worker that restarts starts dense and holds the copy again."""

from __future__ import annotations

import math

import pytest
import torch

from disttrain.compression import topk_count
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, ExchangeRules, WorkerTensors, make_exchange
from disttrain.training.engine import forward_backward
from disttrain.training.models import init_model
from tests.distributed.test_ps_server import make_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
torch.set_num_threads(1)

SHARDS, RATIO, DENSE_EVERY, ROUNDS, FAST = 2, 0.05, 30, 10, 3


class Worker:
    """One worker over gRPC: its model in flat buffers, its client and exchange."""

    def __init__(self, config, addresses: list[str], rank: int, mode: str, bound: int):
        self.model = init_model(config.training)
        self.plans = plan_shards(self.model, SHARDS)
        self.flat, self.grads = flat_parameters(self.model)
        self.client = PSClient(addresses, self.plans, RetryPolicy(timeout_s=20.0), "grpc")
        self.client.register(f"w{rank}", rank, key=bytes([65 + rank]) * 32)
        self.client.compress_pulls("topk", RATIO)
        self.exchange = make_exchange(self.client, f"w{rank}", WorkerTensors(self.flat, self.grads),
                                      ExchangeRules(mode, bound))
        self.rank, self.steps, self.generator = rank, 0, torch.Generator().manual_seed(rank)
        self.exchange.start()

    def step(self) -> None:
        self.steps += 1
        inputs = torch.randn(8, 1, 8, 8, generator=self.generator)
        targets = torch.randint(0, 10, (8,), generator=self.generator)

        def compute():
            self.grads.zero_()
            return forward_backward(self.model, inputs, targets)

        self.exchange.step(compute, Block(self.steps, 1000 * self.rank + self.steps, 0, 8), StepTimer())

    def shard_values(self, shard: int) -> torch.Tensor:
        plan = self.plans[shard]
        return self.flat[plan.offset:plan.offset + plan.numel]


class History:
    """Each shard's broadcast copy and parameters at every version (recorded as the
    shard reaches it, under its lock)."""

    def __init__(self, states):
        self.copies = [{} for _ in states]
        self.params = [{} for _ in states]
        for shard, state in enumerate(states):
            state.on_version = lambda version, shard=shard, state=state: self.record(shard, state, version)
            self.record(shard, state, state.rules.version)

    def record(self, shard, state, version):
        self.copies[shard][version] = state.broadcast.copy.clone()
        self.params[shard][version] = state.param.detach().clone()

    def largest_update(self, shard: int, version: int) -> float:
        params = self.params[shard]
        return max([(params[v] - params[v - 1]).norm().item() for v in range(1, version + 1)], default=0.0)


def expected_bytes(held: int, version: int, change_nbytes: int, dense_nbytes: int) -> int:
    """What the answer at `version` to a worker holding `held` takes (see `BroadcastCopy`)."""
    behind = version - held
    crosses_reset = any(v % DENSE_EVERY == 0 for v in range(held + 1, version + 1))
    if held < 0 or crosses_reset or behind * change_nbytes > dense_nbytes or behind < 1:
        return dense_nbytes
    return behind * change_nbytes


@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.extended)])
def test_workers_at_different_speeds_hold_the_copy_exactly_within_the_sync_bound(tmp_path, mode):
    bound = FAST + 1  # SSP: the fast worker runs FAST steps ahead of the slow one, within it
    config = make_config(tmp_path, num_workers=2, ps={"aggregation_mode": mode, "staleness": bound}).replace(
        compression={"pull": "topk", "pull_ratio": RATIO, "pull_dense_every": DENSE_EVERY})
    servers = [ShardServer(build_state(config, s, SHARDS), "127.0.0.1:0") for s in range(SHARDS)]
    states = [s.state for s in servers]
    history = History(states)
    addresses = [s.address for s in servers]
    fast, slow = (Worker(config, addresses, r, mode, bound) for r in range(2))
    plans = fast.plans
    changes = [ParameterChanges(p, "topk", RATIO).nbytes for p in plans]
    c = [math.sqrt(1 - topk_count(p.numel, RATIO) / p.numel) for p in plans]
    assert changes[0] * 4 < plans[0].nbytes  # a catch-up of several changes still saves bytes
    num_multi = num_resets = 0
    try:
        for round_ in range(ROUNDS):
            if round_ == ROUNDS // 2:
                # The slow worker restarts, resuming at its step: a new process's client
                # holds nothing, so it pulls dense, and holds the copy again.
                slow.client.close()
                steps, slow = slow.steps, Worker(config, addresses, 1, mode, bound)
                slow.steps = steps
                for shard in range(SHARDS):
                    assert torch.equal(slow.shard_values(shard),
                                       history.copies[shard][slow.exchange.versions[shard]])
            # SSP holds the fast worker within the bound of the slow one: it waits while the
            # slow one takes as many steps (each is then as many versions behind).
            for worker in [fast] * FAST + [slow] * (1 if mode == "async" else FAST):
                held, received = list(worker.exchange.versions), worker.client.bytes_received
                worker.step()
                predicted = 0
                for shard in range(SHARDS):
                    version = worker.exchange.versions[shard]
                    values = worker.shard_values(shard)
                    # the shard's broadcast copy at the version it holds, to the bit
                    assert torch.equal(values, history.copies[shard][version])
                    residual = (history.params[shard][version] - values).norm().item()
                    slack = 1e-5 * (values.norm().item() + 1)
                    largest = history.largest_update(shard, version)
                    assert residual <= c[shard] / (1 - c[shard]) * largest + slack
                    predicted += expected_bytes(held[shard], version, changes[shard], plans[shard].nbytes)
                    num_multi += version - held[shard] > 1 and version % DENSE_EVERY != 0
                    num_resets += held[shard] < DENSE_EVERY <= version
                assert worker.client.bytes_received - received == predicted
        assert num_multi > 0  # answers of several changes were sent, and landed exactly
        assert num_resets > 0  # and answers across a dense version
        received = sum(w.client.bytes_received for w in (fast, slow))
        assert received * 3 < sum(w.client.bytes_received_dense for w in (fast, slow))
    finally:
        for worker in (fast, slow):
            worker.client.close()
        for server in servers:
            server.stop(0)
