"""A shard's optimizer besides the step: decay on the weights' ranges only, clipping by
each shard's share of the global norm, and the schedule by the shard's count of updates;
frozen parameters in no shard, so nothing the shards do moves them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from disttrain.config import config_from_dict
from disttrain.strategies.ps.server.optimizer import ShardOptimizer, decayed_ranges
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards

pytestmark = pytest.mark.timeout(30)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))  # 30, 5, 5, 5, 15, 3 elements


def training(**keys):
    return config_from_dict({"training": {"learning_rate": 0.1, **keys}}).training


def shard_optimizers(num_shards, **keys):
    net = model()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    plans = plan_shards(net, num_shards)
    return [ShardOptimizer(nn.Parameter(flat[p.offset:p.offset + p.numel].clone()), p, training(**keys),
                           flat.numel()) for p in plans]


def test_decay_covers_the_weights_only_even_when_a_shard_cuts_a_tensor():
    whole, = plan_shards(model(), 1)
    assert decayed_ranges(whole) == [(0, 30), (45, 60)]
    first, second = plan_shards(model(), 2)  # 63 elements: the cut at 31 falls inside the first bias
    assert decayed_ranges(first) == [(0, 30)]
    assert decayed_ranges(second) == [(45 - 31, 60 - 31)]


def test_one_shard_clips_as_torch_does_and_two_never_exceed_the_global_norm():
    gradient = torch.randn(63, generator=torch.Generator().manual_seed(3)) * 10
    (whole,) = shard_optimizers(1, clip_grad_norm=1.0)
    clipped = gradient.clone()
    whole.prepare(clipped)
    reference = nn.Parameter(torch.zeros(63))
    reference.grad = gradient.clone()
    torch.nn.utils.clip_grad_norm_([reference], 1.0)
    torch.testing.assert_close(clipped, reference.grad, rtol=0, atol=0)

    first, second = shard_optimizers(2, clip_grad_norm=1.0)
    assert first.clip_norm == pytest.approx(math.sqrt(31 / 63))
    assert second.clip_norm == pytest.approx(math.sqrt(32 / 63))
    pieces = [gradient[:31].clone(), gradient[31:].clone()]
    first.prepare(pieces[0])
    second.prepare(pieces[1])
    assert float(torch.cat(pieces).norm()) <= 1.0 + 1e-6
    # A slice inside its share is left alone, even while another is clipped.
    small = torch.cat([gradient[:31] * 1e-3, gradient[31:]])
    left = small[:31].clone()
    first.prepare(left)
    assert torch.equal(left, small[:31])


def test_adamw_shrinks_the_weights_by_the_scheduled_rate_and_nothing_else():
    (shard,) = shard_optimizers(1, optimizer="adamw", weight_decay=0.5, lr_schedule="linear",
                                lr_decay_steps=4)
    shard.applied()
    shard.applied()
    shard.set_rate()  # step 2 of 4: half the rate
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    before = shard.param.detach().clone()
    shard.prepare(torch.zeros(63))
    shrink = torch.ones(63)
    shrink[0:30] = shrink[45:60] = 1 - 0.05 * 0.5
    torch.testing.assert_close(shard.param.detach(), before * shrink)


def test_async_counts_a_step_per_round_of_pushes_and_the_count_is_kept():
    net = model()
    plan, = plan_shards(net, 1)
    halving = training(lr_schedule="step", lr_step_size=1, lr_gamma=0.5)
    shard = ShardOptimizer(nn.Parameter(torch.zeros(63)), plan, halving, 63, updates_per_step=2)
    rates = []
    for _ in range(5):
        shard.set_rate()
        rates.append(shard.optimizer.param_groups[0]["lr"])
        shard.applied()
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    again = ShardOptimizer(nn.Parameter(torch.zeros(63)), plan, training(), 63, updates_per_step=2)
    again.load_state_dict(shard.state_dict())
    assert again.state.num_steps == 5


def test_a_frozen_layer_is_in_no_shard_and_adamw_with_decay_never_moves_it():
    net = model()
    net[0].requires_grad_(False)  # 30 + 5 elements frozen: 28 stay for the shards
    frozen = {name: p.detach().clone() for name, p in net[0].named_parameters()}
    plans = plan_shards(net, 2)
    assert sum(p.numel for p in plans) == 28 and not any({"0.weight", "0.bias"} & p.names for p in plans)
    flat, _ = flat_parameters(net)
    assert flat.numel() == 28
    shards = [ShardOptimizer(nn.Parameter(flat[p.offset:p.offset + p.numel].clone()), p,
                             training(optimizer="adamw", weight_decay=0.5), flat.numel()) for p in plans]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for shard in shards:
            shard.set_rate()
            shard.param.grad = torch.randn(shard.param.numel(), generator=generator)
            shard.prepare(shard.param.grad)
            shard.optimizer.step()
            shard.applied()
    with torch.no_grad():  # the shards' parameters back into the model, as a worker's pull does
        for plan, shard in zip(plans, shards, strict=True):
            flat[plan.offset:plan.offset + plan.numel] = shard.param
    assert all(torch.equal(p, frozen[name]) for name, p in net[0].named_parameters())
    assert not torch.equal(net[2].weight, model()[2].weight)  # the trainable ones moved
