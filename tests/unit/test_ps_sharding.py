"""Sharding: byte-balanced contiguous shards, slices of large tensors, flat buffers."""

import pytest
import torch

from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards, state_dict_from_flat
from disttrain.training.models import SimpleCNN, build_model


@pytest.mark.parametrize("num_shards", [2, 4])
def test_simplecnn_shards_are_balanced_within_10_percent(num_shards):
    plans = plan_shards(SimpleCNN((1, 28, 28)), num_shards)
    total = sum(p.nbytes for p in plans)
    assert max(p.nbytes for p in plans) <= 1.1 * total / num_shards
    # fc1.weight is 95% of the model: balance needs it split across shards
    assert sum("fc1.weight" in p.names for p in plans) >= 2


@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_slices_cover_every_element_once_in_order(num_shards):
    model = build_model("mlp", (1, 8, 8), 10)
    plans = plan_shards(model, num_shards)
    covered = {name: torch.zeros(p.numel(), dtype=torch.int32) for name, p in model.named_parameters()}
    offset = 0
    for plan in plans:
        assert plan.offset == offset and plan.numel == sum(s.length for s in plan.slices)
        offset += plan.numel
        for s in plan.slices:
            covered[s.name][s.start:s.start + s.length] += 1
    assert all(bool((c == 1).all()) for c in covered.values())


def test_more_shards_than_parameters_is_refused():
    with pytest.raises(ValueError, match="cannot split"):
        plan_shards(torch.nn.Linear(2, 1), 4)


def test_flat_parameters_are_views_and_backward_fills_the_flat_gradient():
    model = build_model("mlp", (1, 8, 8), 10)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    flat, grads = flat_parameters(model)
    assert all(torch.equal(p, reference[name]) for name, p in model.named_parameters())
    flat.add_(1.0)
    assert torch.equal(next(model.parameters()), next(iter(reference.values())) + 1.0)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    assert grads.abs().sum() > 0
    assert grads.data_ptr() == next(model.parameters()).grad.data_ptr()
    state = state_dict_from_flat(model, flat)
    assert torch.equal(state["net.1.weight"], model.net[1].weight)
