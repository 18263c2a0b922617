"""A model of odd parameters on real shard servers over gRPC: a 0-d scalar, a zero-size
tensor, many small vectors, 3-d and 4-d tensors, one huge vector (streamed in chunks:
each shard's payload is over one message), and BatchNorm buffers. One synchronous step
of SGD lands on every shard exactly, buffers included, and the worker gets it all back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disttrain.config import CompressionConfig, TrainingConfig
from disttrain.metrics.window import StepTimer
from disttrain.strategies.ps.server.aggregation import AggregationRules
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.server.shard import ShardCodecs, ShardState, ShardValues
from disttrain.strategies.ps.server.validation import PushDecoder
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.sharding import flat_parameters, initial_buffers, plan_shards
from disttrain.strategies.ps.worker.buffers import WorkerBuffers
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, WorkerTensors, make_exchange
from disttrain.training.engine import StepResult

pytestmark = pytest.mark.timeout(90)

LR = 0.1
HUGE = 2_500_000  # 10 MB of float32: each of 2 shards holds over one message's 4 MB


class OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.scalar = nn.Parameter(torch.tensor(0.5))
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.small = nn.ParameterList([nn.Parameter(torch.randn(k, generator=generator))
                                       for k in (1, 2, 3, 5, 7)])
        self.conv = nn.Parameter(torch.randn(4, 3, 3, 3, generator=generator))
        self.cube = nn.Parameter(torch.randn(2, 3, 5, generator=generator))
        self.huge = nn.Parameter(torch.randn(HUGE, generator=generator))
        self.norm = nn.BatchNorm1d(7)


def shard_servers(model: nn.Module, num_shards: int):
    training = TrainingConfig(optimizer="sgd", momentum=0.0, learning_rate=LR)
    plans = plan_shards(model, num_shards)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    servers = []
    for plan in plans:
        values = ShardValues(plan, flat[plan.offset:plan.offset + plan.numel], initial_buffers(model, plan))
        state = ShardState(values, AggregationRules("sync", 1),
                           ShardCodecs(PushDecoder(plan, CompressionConfig())), training)
        servers.append(ShardServer(state, "127.0.0.1:0"))
    return plans, servers


def test_one_sync_step_of_an_odd_model_lands_on_every_shard(tmp_path):
    model = OddModel()
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    plans, servers = shard_servers(OddModel(), 2)
    assert all(not service.fits_one_message(plan.nbytes) for plan in plans)  # streamed both ways
    assert sum(len(plan.buffers) for plan in plans) == 3
    flat, grads = flat_parameters(model)
    client = PSClient([s.address for s in servers], plans, RetryPolicy(timeout_s=20.0, max_attempts=2),
                      "grpc")
    try:
        client.register("w0", 0, key=b"A" * 32)
        buffers = WorkerBuffers(model, plans, client.shards)
        exchange = make_exchange(client, "w0", WorkerTensors(flat, grads, buffers))
        exchange.start()
        gradient = torch.linspace(-1.0, 1.0, flat.numel())

        def compute() -> StepResult:
            buffers.adopt()
            buffers.begin()
            grads.copy_(gradient)
            with torch.no_grad():  # a forward pass's effect on the buffers
                model.norm.running_mean.add_(0.25)
                model.norm.num_batches_tracked.add_(1)
            buffers.finish()
            return StepResult(0.0, 0, 1)

        exchange.step(compute, Block(1, 1, 0, 8), StepTimer())
        expected = initial - LR * gradient
        torch.testing.assert_close(flat, expected, rtol=0, atol=1e-6)  # the worker holds the step
        held = torch.cat([s.state.parameters() for s in servers])
        torch.testing.assert_close(held, expected, rtol=0, atol=1e-6)
        values = {slot.name: s.state.buffer_values()[sum(b.numel for b in plan.buffers[:i]):][:slot.numel]
                  for s, plan in zip(servers, plans, strict=True) for i, slot in enumerate(plan.buffers)}
        assert values["norm.running_mean"].tolist() == [0.25] * 7
        assert values["norm.running_var"].tolist() == [1.0] * 7
        assert values["norm.num_batches_tracked"].tolist() == [1.0]
        assert model.scalar.shape == () and model.empty.shape == (0, 3)
    finally:
        client.close()
        for server in servers:
            server.stop(0)
