"""Learning-rate schedules, parameter groups and the optimizer step of one process: the
curves at their corners, the rate set on every group, and the count a checkpoint keeps."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from disttrain.config import config_from_dict
from disttrain.core.errors import ConfigError
from disttrain.training.engine import build_optimizer, parameter_groups
from disttrain.training.schedule import LRSchedule
from disttrain.training.stepping import OptimizerStep

pytestmark = pytest.mark.timeout(30)


def training(**keys):
    return config_from_dict({"training": {"learning_rate": 0.1, **keys}}).training


def test_constant_is_every_step_the_configured_rate_and_sets_nothing():
    schedule = LRSchedule.of(training())
    assert schedule.constant and all(schedule.factor(n) == 1.0 for n in (0, 1, 10**6))


def test_warmup_rises_linearly_from_the_first_step_then_cosine_falls_to_the_floor():
    schedule = LRSchedule.of(training(lr_schedule="cosine", warmup_steps=4, lr_decay_steps=14, lr_min=0.01))
    assert [schedule.factor(n) for n in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule.factor(4) == 1.0
    assert schedule.factor(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: the mean of 1 and the floor
    assert schedule.factor(14) == pytest.approx(0.1) and schedule.factor(1000) == pytest.approx(0.1)
    factors = [schedule.factor(n) for n in range(3, 20)]
    assert all(a >= b for a, b in zip(factors, factors[1:], strict=False))


def test_linear_decay_and_step_decay():
    linear = LRSchedule.of(training(lr_schedule="linear", lr_decay_steps=10))
    assert [linear.factor(n) for n in (0, 5, 10, 11)] == [1.0, 0.5, 0.0, 0.0]
    step = LRSchedule.of(training(lr_schedule="step", lr_step_size=3, lr_gamma=0.5))
    assert [step.factor(n) for n in range(7)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]


@pytest.mark.parametrize("keys, fragment", [
    ({"lr_schedule": "cosine"}, "training.lr_decay_steps: 0 must be greater than training.warmup_steps"),
    ({"lr_schedule": "linear", "warmup_steps": 5, "lr_decay_steps": 5}, "must be greater than"),
    ({"lr_min": 0.5}, "training.lr_min: 0.5 must be at most training.learning_rate"),
    ({"lr_schedule": "exp"}, "training.lr_schedule: 'exp' must be one of constant, step, cosine, linear"),
    ({"clip_grad_norm": -1}, "training.clip_grad_norm: -1.0 must be >= 0"),
    ({"optimizer": "lion"}, "must be one of sgd, adam, adamw"),
])
def test_bad_schedule_keys_name_the_field(keys, fragment):
    with pytest.raises(ConfigError, match=fragment):
        training(**keys)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_adamw_groups_decay_weights_and_leave_biases_and_norm_weights_alone():
    net = model()
    optimizer = build_optimizer(net.parameters(), training(optimizer="adamw", weight_decay=0.5))
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.5 and kept["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(net[0].weight), id(net[2].weight)}
    assert {id(p) for p in kept["params"]} == {id(net[0].bias), id(net[1].weight), id(net[1].bias),
                                               id(net[2].bias)}
    # A step with zero gradients moves only what decays.
    before = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    moved = [not torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True)]
    assert moved == [p.dim() >= 2 for p in net.parameters()]
    # Without weight decay the same two groups, so a checkpoint fits whatever the decay.
    assert [len(g["params"]) for g in parameter_groups(net.parameters(), 0.0)] == [2, 4]


def test_optimizer_step_sets_each_steps_rate_clips_and_resumes_its_count():
    config = training(optimizer="sgd", momentum=0.0, lr_schedule="linear", warmup_steps=2,
                      lr_decay_steps=6, clip_grad_norm=1.0)
    net = model()
    stepper = OptimizerStep(build_optimizer(net.parameters(), config), config)
    rates, norms = [], []
    for _ in range(4):
        for p in net.parameters():
            p.grad = torch.full_like(p, 3.0)
        stepper.step()
        rates.append(stepper.learning_rate)
        norms.append(math.sqrt(sum(float(p.grad.square().sum()) for p in net.parameters())))
    assert rates == pytest.approx([0.05, 0.1, 0.1, 0.075])
    assert norms == pytest.approx([1.0] * 4)  # clipped to the global norm, every tensor together
    assert stepper.last_grad_norm > 1.0

    resumed = OptimizerStep(build_optimizer(model().parameters(), config), config)
    resumed.load_state_dict(stepper.state_dict())
    assert resumed.state.num_steps == 4
    for p in (p for group in resumed.optimizer.param_groups for p in group["params"]):
        p.grad = torch.zeros_like(p)
    resumed.step()
    assert resumed.learning_rate == pytest.approx(0.05)  # step 4: halfway down from step 2 to 6


@pytest.mark.parametrize("earlier, fragment", [
    (lambda state: {**state, "optimizer": {**state["optimizer"], "param_groups": [
        {**state["optimizer"]["param_groups"][0], "params": list(range(6))}]}},
     "its optimizer has 1 parameter group"),  # one group: written before groups existed
    (lambda state: {k: v for k, v in state.items() if k != "schedule"},
     "holds no learning-rate schedule"),  # written before schedules were saved
])
def test_an_earlier_disttrains_optimizer_state_is_refused_in_one_line(earlier, fragment):
    config = training(optimizer="sgd")
    stepper = OptimizerStep(build_optimizer(model().parameters(), config), config)
    state = earlier(stepper.state_dict())
    with pytest.raises(ValueError, match=fragment) as info:
        OptimizerStep(build_optimizer(model().parameters(), config), config).load_state_dict(state)
    assert "earlier disttrain" in str(info.value) and "start a fresh run" in str(info.value)
    assert "\n" not in str(info.value)
