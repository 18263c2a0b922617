"""The shard's update: steps that cannot overflow go unguarded, and are exactly the
optimizer's; a step that would leave a value non-finite is refused and undone, after any
number of unguarded ones."""

import pytest
import torch
from torch import nn

from disttrain.strategies.ps.server.decisions import Contribution
from disttrain.strategies.ps.server.update import GuardedUpdate
from disttrain.strategies.ps.server.validation import bounded

SGD_SETTINGS = [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                dict(momentum=0.5, dampening=0.3, weight_decay=0.1, maximize=True)]


def update_of(optimizer_class, **settings):
    param = nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    return param, GuardedUpdate(param, optimizer_class([param], **settings))


def gradients(num, scale=1.0):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1000, generator=generator) * scale for _ in range(num)]


@pytest.mark.parametrize("settings", SGD_SETTINGS)
def test_sgd_steps_that_cannot_overflow_are_not_guarded_and_equal_the_optimizers(settings):
    param, update = update_of(torch.optim.SGD, lr=0.1, **settings)
    reference = nn.Parameter(param.detach().clone())
    optimizer = torch.optim.SGD([reference], lr=0.1, **settings)
    for gradient in gradients(50):
        assert update.apply([Contribution(0, 1.0, bounded([gradient]))])
        reference.grad = gradient.clone()
        optimizer.step()
        assert update.bounds["param"] >= param.detach().abs().max().item()
    assert update.num_guarded == 1  # only the first step: nothing was known before it
    torch.testing.assert_close(param.detach(), reference.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("optimizer_class, settings", [(torch.optim.SGD, dict(momentum=0.9)),
                                                       (torch.optim.Adam, {})])
def test_an_overflowing_step_is_refused_after_unguarded_ones(optimizer_class, settings):
    param, update = update_of(optimizer_class, lr=4.0, **settings)
    for gradient in gradients(5):
        assert update.apply([Contribution(0, 1.0, bounded([gradient]))])
    before = param.detach().clone()
    state = {k: v.clone() for k, v in update.optimizer.state[param].items()}
    huge = torch.full((1000,), 3e38)
    assert not update.apply([Contribution(0, 1.0, bounded([huge]))])
    assert torch.equal(param.detach(), before)
    assert all(torch.equal(update.optimizer.state[param][k], v) for k, v in state.items())
    assert update.apply([Contribution(0, 1.0, bounded([torch.ones(1000)]))])  # and it goes on


@pytest.mark.parametrize("settings", [{}, dict(weight_decay=0.1), dict(betas=(0.5, 0.9)),
                                      dict(weight_decay=0.01, decoupled_weight_decay=True)])
def test_adam_steps_are_not_guarded_and_equal_the_optimizers(settings):
    param, update = update_of(torch.optim.Adam, lr=0.1, **settings)
    reference = nn.Parameter(param.detach().clone())
    optimizer = torch.optim.Adam([reference], lr=0.1, **settings)
    scales = [1e-6, 1e3, 1.0, 1e-3, 1e6]  # the step stays bounded whatever the gradients' scale
    for i, gradient in enumerate(gradients(50)):
        gradient = gradient * scales[i % len(scales)]
        assert update.apply([Contribution(0, 1.0, bounded([gradient]))])
        reference.grad = gradient.clone()
        optimizer.step()
        state = update.optimizer.state[param]
        assert update.bounds["param"] >= param.detach().abs().max().item()
        assert update.bounds["exp_avg"] >= state["exp_avg"].abs().max().item()
        assert update.bounds["exp_avg_sq"] >= state["exp_avg_sq"].abs().max().item()
    assert update.num_guarded == 1
    torch.testing.assert_close(param.detach(), reference.detach(), rtol=0, atol=0)


def test_unbounded_gradients_and_other_optimizers_are_always_guarded():
    param, update = update_of(torch.optim.SGD, lr=0.1)
    for gradient in gradients(3):
        assert update.apply([Contribution(0, 1.0, [gradient])])  # chunks without a bound
    assert update.num_guarded == 3
    param, update = update_of(torch.optim.Adam, lr=0.1, amsgrad=True)
    for gradient in gradients(3):
        assert update.apply([Contribution(0, 1.0, bounded([gradient]))])
    assert update.num_guarded == 3


def test_large_bounds_guard_the_step_again():
    param, update = update_of(torch.optim.SGD, lr=1.0)
    update.apply([Contribution(0, 1.0, bounded([torch.ones(1000)]))])
    big = torch.full((1000,), 2 * update.limit)
    assert update.apply([Contribution(0, 1.0, bounded([big]))])  # finite, but only just: guarded
    assert update.num_guarded == 2


def test_a_non_finite_gradient_is_refused_by_the_decoder():
    with pytest.raises(ValueError, match="NaN or infinite"):
        bounded([torch.tensor([1.0, float("inf")])])
    bound = bounded([torch.tensor([1.0, -3.0]), torch.tensor([2.0])]).bound
    assert 3.0 <= bound <= 14**0.5  # at least the largest magnitude, at most the whole norm
