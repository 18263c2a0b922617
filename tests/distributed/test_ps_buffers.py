"""Model buffers (BatchNorm's running statistics and batch counter) on a real shard
server, driven by real worker exchanges over gRPC and shared memory.

The rule: each push carries the change the worker's step made to the buffers, and the
shard moves its buffers by the weighted sum of the changes it applies (async: each whole);
every answer brings the buffers of its version. Malformed buffers are refused and change
nothing; a restarted shard comes back with the buffers it saved.
"""

from __future__ import annotations

import pytest
import torch

from disttrain.compression import Compressor
from disttrain.config import config_from_dict
from disttrain.core.errors import DistributedError
from disttrain.metrics.window import StepTimer
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.payloads import GradientEncoder
from disttrain.strategies.ps.wire.sharding import flat_parameters, initial_buffers, plan_shards
from disttrain.strategies.ps.worker.buffers import WorkerBuffers
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.strategies.ps.worker.exchange import Block, ExchangeRules, WorkerTensors, make_exchange
from disttrain.training.engine import forward_backward
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(90)

BATCH = 8


def make_config(tmp_path, mode="sync", workers=1, compression=None):
    return config_from_dict({
        "compression": compression or {},
        "training": {"dataset": "digits", "model_architecture": "mlp_bn", "optimizer": "sgd", "momentum": 0.0,
                     "learning_rate": 0.1, "mlp_hidden_size": 16, "mlp_num_layers": 2,
                     "checkpoint_interval": 1, "max_train_samples": 64},
        "ps": {"aggregation_mode": mode},
        "system": {"num_workers": workers, "checkpoint_dir": str(tmp_path / "ckpt")}})


class Worker:
    """One worker's model, client, buffers and exchange, as `run_worker` builds them."""

    def __init__(self, config, address: str, rank: int, transport: str):
        self.model = init_model(config.training)
        self.flat, self.grads = flat_parameters(self.model)
        self.client = PSClient([address], plan_shards(self.model, 1),
                               RetryPolicy(timeout_s=10.0, max_attempts=2), transport)
        self.client.register(f"w{rank}", rank, key=bytes([65 + rank]) * 32)
        self.buffers = WorkerBuffers(self.model, self.client.plans, self.client.shards)
        encoder = None
        if config.compression.enabled:
            encoder = GradientEncoder(Compressor.from_config(config.compression, rank), self.client.plans)
        self.exchange = make_exchange(self.client, f"w{rank}",
                                      WorkerTensors(self.flat, self.grads, self.buffers),
                                      ExchangeRules(config.ps.aggregation_mode, config.ps.staleness), encoder)
        self.exchange.start()
        self.rank = rank
        generator = torch.Generator().manual_seed(rank)
        self.inputs = torch.rand(BATCH, 1, 8, 8, generator=generator) * (rank + 1)
        self.targets = torch.randint(0, 10, (BATCH,), generator=generator)

    def step(self, step: int) -> torch.Tensor:
        """One step as the participant computes it; returns the buffer change pushed."""

        def compute():
            self.grads.zero_()
            self.buffers.adopt()
            self.buffers.begin()
            result = forward_backward(self.model, self.inputs, self.targets)
            self.buffers.finish()
            return result

        self.exchange.step(compute, Block(step, step * 10 + self.rank, 0, BATCH), StepTimer())
        return self.buffers._changes[0].clone()

    def close(self):
        self.client.close()


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_async_moves_the_buffers_by_each_push_change_and_answers_them(tmp_path, transport):
    config = make_config(tmp_path, "async", workers=2)
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    workers = [Worker(config, server.address, rank, transport) for rank in range(2)]
    try:
        start = state.buffer_values()
        assert torch.equal(start, initial_buffers(init_model(config.training), state.plan))
        changes = [workers[0].step(1), workers[1].step(1)]  # both computed on version 0's buffers
        assert all(change.abs().sum() > 0 for change in changes)
        torch.testing.assert_close(state.buffer_values(), start + changes[0] + changes[1], rtol=0, atol=1e-12)
        counters = [i for i, name in enumerate(_names(state.plan)) if name.endswith("num_batches_tracked")]
        assert state.buffer_values()[counters].tolist() == [2.0, 2.0]  # one per batch applied
        # worker 1's answer brought version 2's buffers: its model holds the server's now
        workers[1].buffers.adopt()
        named = dict(workers[1].model.named_buffers())
        offset = 0
        for slot in state.plan.buffers:
            held = state.buffer_values()[offset:offset + slot.numel].view(slot.shape)
            torch.testing.assert_close(named[slot.name].double(), held, rtol=0, atol=1e-6)
            offset += slot.numel
    finally:
        for worker in workers:
            worker.close()
        server.stop(0)


@pytest.mark.parametrize("scheme", ["quantization", "topk"])
def test_a_compressed_push_carries_its_buffers_raw(tmp_path, scheme):
    config = make_config(tmp_path, compression={"enabled": True, "type": scheme, "ratio": 0.1})
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    worker = Worker(config, server.address, 0, "grpc")
    try:
        start = state.buffer_values()
        change = worker.step(1)
        assert change.abs().sum() > 0 and state.version == 1
        # one worker in sync mode: the shard's buffers are the worker's, exactly
        torch.testing.assert_close(state.buffer_values(), start + change, rtol=0, atol=0)
    finally:
        worker.close()
        server.stop(0)


def _names(plan):
    """Each buffer element's tensor name, in the shard's flat order."""
    return [slot.name for slot in plan.buffers for _ in range(slot.numel)]


def test_a_restarted_shard_comes_back_with_its_buffers(tmp_path):
    config = make_config(tmp_path)
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    worker = Worker(config, server.address, 0, "grpc")
    try:
        for step in (1, 2):
            worker.step(step)
        held = state.buffer_values()
        assert not torch.equal(held, initial_buffers(init_model(config.training), state.plan))
    finally:
        worker.close()
        server.stop(0)  # writes the final checkpoint
    restored = build_state(config, 0, 1, resume=True)
    assert restored.version == 2
    torch.testing.assert_close(restored.buffer_values(), held, rtol=0, atol=0)
    # and from state_dict alone, as every stateful part comes back
    fresh = build_state(make_config(tmp_path / "other"), 0, 1)
    fresh.load_state_dict(restored.state_dict())
    torch.testing.assert_close(fresh.buffer_values(), held, rtol=0, atol=0)


MALFORMED = {
    "missing": lambda plan: None,
    "short": lambda plan: service.buffer_proto(torch.zeros(plan.buffer_numel - 1)),
    "NaN": lambda plan: service.buffer_proto(torch.full((plan.buffer_numel,), float("nan"))),
    "float32": lambda plan: _as_float32(plan),
}


def _as_float32(plan):
    proto = service.buffer_proto(torch.zeros(plan.buffer_numel))
    proto.dtype = "float32"
    return proto


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_push_with_malformed_buffers_is_refused_and_changes_nothing(tmp_path, case):
    config = make_config(tmp_path)
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    client = PSClient([server.address], [state.plan], RetryPolicy(timeout_s=10.0, max_attempts=2), "grpc")
    try:
        client.register("w0", 0, key=b"A" * 32)
        before = state.buffer_values()
        header = pb.GradientMessage(worker_id="w0", step=1, shard=0, base_version=0, block_id=1,
                                    num_samples=8)
        buffers = MALFORMED[case](state.plan)
        if buffers is not None:
            header.buffers.CopyFrom(buffers)
        with pytest.raises(DistributedError, match="INVALID_ARGUMENT.*buffers"):
            client.push([header], torch.zeros(state.plan.numel), [0])
        assert state.version == 0 and torch.equal(state.buffer_values(), before)
    finally:
        client.close()
        server.stop(0)


def test_buffers_of_a_model_without_any_are_refused(tmp_path):
    config = config_from_dict({"training": {"dataset": "digits", "model_architecture": "mlp",
                                            "mlp_hidden_size": 16},
                               "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt")}})
    state = build_state(config, 0, 1)
    assert state.plan.buffers == () and state.buffer_values().numel() == 0
    server = ShardServer(state, "127.0.0.1:0")
    client = PSClient([server.address], [state.plan], RetryPolicy(timeout_s=10.0, max_attempts=2), "grpc")
    try:
        client.register("w0", 0, key=b"A" * 32)
        header = pb.GradientMessage(worker_id="w0", step=1, shard=0, base_version=0, block_id=1,
                                    num_samples=8, buffers=service.buffer_proto(torch.zeros(3)))
        with pytest.raises(DistributedError, match="carries buffers, but shard 0 holds none"):
            client.push([header], torch.zeros(state.plan.numel), [0])
        assert state.version == 0
    finally:
        client.close()
        server.stop(0)
