"""A worker's buffers on their own: what an answer brought is taken into the model (a
counter's weighted sum rounded, not truncated), the change a forward pass makes is what
a push carries, and a shard without buffers carries none. The shards' clients are
stand-ins holding only what their last answer brought."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.sharding import initial_buffers, plan_shards
from disttrain.strategies.ps.worker.buffers import WorkerBuffers


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def test_adopt_takes_the_answer_and_rounds_counters():
    net = model()
    (plan,) = plan_shards(net, 1)
    shard = SimpleNamespace(buffers=None)
    buffers = WorkerBuffers(net, [plan], [shard])
    buffers.adopt()  # nothing arrived yet: the model keeps its own
    assert torch.equal(net[1].running_var, torch.ones(4))
    # running_mean (4), running_var (4), num_batches_tracked (1), as a weighted sum left them
    shard.buffers = torch.tensor([0.5, 1.5, -2.0, 0.0, 2.0, 2.0, 3.0, 4.0, 2.9999999999], dtype=torch.float64)
    buffers.adopt()
    assert net[1].running_mean.tolist() == [0.5, 1.5, -2.0, 0.0]
    assert net[1].running_var.tolist() == [2.0, 2.0, 3.0, 4.0]
    assert int(net[1].num_batches_tracked) == 3


def test_the_change_of_a_forward_pass_is_what_a_push_carries():
    net = model()
    plans = plan_shards(net, 2)
    assert all(plan.buffers for plan in plans)  # spread over both shards
    buffers = WorkerBuffers(net, plans, [SimpleNamespace(buffers=None) for _ in plans])
    before = [initial_buffers(net, plan) for plan in plans]
    buffers.begin()
    net.train()
    net(torch.randn(8, 6))
    buffers.finish()
    moved = 0.0
    for shard, plan in enumerate(plans):
        message = SimpleNamespace(HasField=lambda name: True, buffers=buffers.change(shard))
        change = service.read_buffers(message, plan, "push")
        torch.testing.assert_close(before[shard] + change, initial_buffers(net, plan), rtol=0, atol=0)
        names = [slot.name for slot in plan.buffers for _ in range(slot.numel)]
        if "1.num_batches_tracked" in names:
            assert change[names.index("1.num_batches_tracked")] == 1.0  # one batch
        moved += float(change.abs().sum())
    assert moved > 1.0  # the statistics moved too


def test_a_model_without_buffers_pushes_none():
    net = torch.nn.Linear(6, 2)
    (plan,) = plan_shards(net, 1)
    buffers = WorkerBuffers(net, [plan], [SimpleNamespace(buffers=None)])
    assert not buffers.any and buffers.change(0) is None


def test_a_plan_of_another_model_is_refused():
    plans = plan_shards(model(), 1)
    with pytest.raises(ValueError, match="buffers .* the model does not have"):
        WorkerBuffers(torch.nn.Linear(6, 2), plans, [SimpleNamespace(buffers=None)])
