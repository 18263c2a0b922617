"""Sharding: byte-balanced contiguous shards of any parameter set (0-d, zero-size, many
small tensors, one huge one, odd shapes), slices of large tensors, buffers placed whole,
the plan's log line, flat buffers."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import assume, given, settings

from disttrain.strategies.ps.wire.sharding import flat_parameters, log_plan, plan_shards, state_dict_from_flat
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
    with pytest.raises(ValueError, match="cannot split 3 parameter elements into 4 shards"):
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


class Shapes(torch.nn.Module):
    """A model whose parameters have the given shapes (and BatchNorm buffers of the given widths)."""

    def __init__(self, shapes, norms=()):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(shape)) for shape in shapes])
        self.norms = torch.nn.ModuleList([torch.nn.BatchNorm1d(width) for width in norms])


SHAPES = st.lists(st.one_of(
    st.just(()),  # 0-d
    st.tuples(st.integers(0, 40)),  # 1-d, zero-size included
    st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4)),  # 3-d
    st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),  # 4-d conv
    st.tuples(st.integers(2_000, 60_000)),  # one huge next to tiny ones
), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(SHAPES, st.lists(st.integers(1, 64), max_size=4), st.integers(1, 9))
def test_any_parameter_set_is_cut_into_balanced_shards_covering_each_element_once(shapes, norms, num_shards):
    model = Shapes(shapes, norms)
    total = sum(p.numel() for p in model.parameters())
    assume(total >= 1)
    if num_shards > total:
        with pytest.raises(ValueError, match="ps.num_servers"):
            plan_shards(model, num_shards)
        return
    plans = plan_shards(model, num_shards)
    # balanced: every shard within one element of total / S, however the sizes are mixed
    assert all(abs(p.numel - total / num_shards) <= 1 for p in plans)
    covered = {name: torch.zeros(p.numel(), dtype=torch.int32) for name, p in model.named_parameters()}
    offset = 0
    for plan in plans:
        assert plan.offset == offset and plan.numel == sum(s.length for s in plan.slices)
        offset += plan.numel
        for s in plan.slices:
            assert s.length > 0 and s.shape == tuple(dict(model.named_parameters())[s.name].shape)
            covered[s.name][s.start:s.start + s.length] += 1
    assert offset == total and all(bool((c == 1).all()) for c in covered.values())
    # buffers: each placed whole exactly once; none makes its shard heavier than the
    # lightest one plus that buffer (the greedy rule)
    placed = [b.name for plan in plans for b in plan.buffers]
    assert sorted(placed) == sorted(name for name, _ in model.named_buffers())
    loads = [p.nbytes + p.buffer_nbytes for p in plans]
    biggest = max((b.nbytes for plan in plans for b in plan.buffers), default=0)
    assert max(loads) - min(loads) <= 4 + biggest
    for plan in plans:
        line = plan.describe()
        assert f"shard {plan.shard}/{num_shards}: {len(plan.slices)} parameter tensor(s)" in line
        assert f"{plan.nbytes} bytes" in line and f"{len(plan.buffers)} buffer(s)" in line


def test_the_plan_is_logged_one_line_per_shard(caplog):
    model = Shapes([(), (5,), (300,), (3, 3, 2, 2)], norms=[4])
    with caplog.at_level("INFO", logger="disttrain.strategies.ps.wire.sharding"):
        log_plan(plan_shards(model, 3))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("shard plan: 3 shard(s)") and len(lines) == 4
    assert [line.strip().split(":")[0] for line in lines[1:]] == ["shard 0/3", "shard 1/3", "shard 2/3"]


def test_a_model_without_trainable_parameters_is_refused():
    with pytest.raises(ValueError, match="no trainable parameters"):
        plan_shards(torch.nn.BatchNorm1d(3, affine=False), 1)
    with pytest.raises(ValueError, match="no trainable parameters"):
        plan_shards(torch.nn.Linear(3, 2).requires_grad_(False), 1)


def test_bool_and_non_persistent_buffers_stay_with_the_worker(caplog):
    model = Shapes([(4,)], norms=[2])
    model.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    model.register_buffer("scratch", torch.zeros(5), persistent=False)
    with caplog.at_level("WARNING", logger="disttrain.strategies.ps.wire.sharding"):
        (plan,) = plan_shards(model, 1)
    assert [b.name for b in plan.buffers] == ["norms.0.running_mean", "norms.0.running_var",
                                              "norms.0.num_batches_tracked"]
    assert "mask" in caplog.text and "scratch" not in caplog.text
