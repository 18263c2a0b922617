"""Local updates (LocalSGD / DiLoCo) without processes: the config's rules and one-line
errors, the flags, the keys other strategies ignore, DDP's refusals, and the outer
optimizer's rounds, its step (against torch's SGD on the pseudo-gradient) and its state."""

from __future__ import annotations

import argparse

import pytest
import torch

from disttrain.cli.flags import LOCAL_UPDATE_FLAGS, add_config_flags, config_from_args
from disttrain.config import Config, config_from_dict
from disttrain.config.usage import ignored_keys
from disttrain.core.errors import ConfigError
from disttrain.strategies.ddp.runtime import check_supported
from disttrain.strategies.ps.run.launcher import check_supported as check_ps_supported
from disttrain.strategies.ps.server.optimizer import ShardOptimizer
from disttrain.strategies.ps.wire.sharding import flat_parameters, plan_shards
from disttrain.strategies.ps.worker.local_rounds import WorkerRounds, round_end
from disttrain.training.local_updates import LocalUpdates, OuterOptimizer


@pytest.mark.parametrize("training, fragment", [
    ({"sync_every": 0}, "training.sync_every: 0 must be >= 1 (1 = every step)"),
    ({"outer_learning_rate": -0.5}, "training.outer_learning_rate: -0.5 must be > 0"),
    ({"outer_learning_rate": 0.0}, "training.outer_learning_rate: 0.0 must be > 0"),
    ({"outer_momentum": 1.0}, "training.outer_momentum: 1.0 must be in [0, 1)"),
    ({"outer_momentum": -0.1}, "training.outer_momentum: -0.1 must be in [0, 1)"),
    ({"outer_optimizer": "adam"}, "training.outer_optimizer: 'adam' must be one of sgd, nesterov"),
    ({"outer_optimizer": "nesterov", "outer_momentum": 0.0},
     "training.outer_momentum: nesterov needs a momentum in (0, 1)"),
])
def test_bad_local_update_settings_are_one_line_naming_the_key(training, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"sync_every": 4, **training}})
    assert any(fragment in line for line in info.value.problems), info.value.problems
    assert all("\n" not in line for line in info.value.problems)


def test_the_outer_momentum_defaults_to_the_outer_optimizers_own():
    """nesterov alone takes DiLoCo's momentum (0.9); sgd alone averages (0); a momentum given
    is kept, and the config written out holds the one the run used."""
    nesterov = config_from_dict({"training": {"sync_every": 4, "outer_optimizer": "nesterov"}})
    assert LocalUpdates.of(nesterov.training) == LocalUpdates(4, "nesterov", 1.0, 0.9)
    assert nesterov.to_dict()["training"]["outer_momentum"] == 0.9
    assert config_from_dict({"training": {"sync_every": 4}}).training.outer_momentum == 0.0
    given = config_from_dict({"training": {"sync_every": 4, "outer_optimizer": "nesterov",
                                           "outer_momentum": 0.5}})
    assert given.training.outer_momentum == 0.5
    assert config_from_dict(nesterov.to_dict()) == nesterov  # read back as written


def test_the_mode_is_off_at_sync_every_one_unless_asked_for():
    assert LocalUpdates.of(Config().training) is None
    on = config_from_dict({"training": {"sync_every": 8, "outer_optimizer": "nesterov",
                                        "outer_learning_rate": 0.7, "outer_momentum": 0.9}})
    assert LocalUpdates.of(on.training) == LocalUpdates(8, "nesterov", 0.7, 0.9)
    forced = config_from_dict({"training": {"local_updates": True}})
    assert LocalUpdates.of(forced.training) == LocalUpdates(1, "sgd", 1.0, 0.0)


def test_flags_set_the_keys():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", default=[])
    add_config_flags(parser, LOCAL_UPDATE_FLAGS)
    args = parser.parse_args(["--sync-every", "32", "--outer-optimizer", "nesterov", "--outer-lr", "0.7",
                              "--outer-momentum", "0.9", "--local-updates"])
    training = config_from_args(args).training
    assert (training.sync_every, training.outer_optimizer, training.outer_learning_rate,
            training.outer_momentum, training.local_updates) == (32, "nesterov", 0.7, 0.9, True)


def test_other_strategies_say_they_ignore_the_keys():
    config = config_from_dict({"training": {"sync_every": 4, "outer_learning_rate": 0.5}})
    assert {k.key for k in ignored_keys(config, "baseline")} >= {"training.sync_every",
                                                                "training.outer_learning_rate"}
    assert not ignored_keys(config, "ddp")
    # The parameter server takes them; its overlapped push is off in the mode (once a round).
    assert not ignored_keys(config, "ps")
    overlap = config_from_dict({"training": {"sync_every": 4}, "ps": {"overlap": False}})
    assert [k.key for k in ignored_keys(overlap, "ps")] == ["ps.overlap"]
    assert not ignored_keys(config_from_dict({"ps": {"overlap": False}}), "ps")
    # The DDP wrapper's knobs do nothing with local updates; outer settings without them neither.
    wrapper = config_from_dict({"training": {"sync_every": 4}, "ddp": {"bucket_cap_mb": 5.0}})
    assert [k.key for k in ignored_keys(wrapper, "ddp")] == ["ddp.bucket_cap_mb"]
    idle = config_from_dict({"training": {"outer_learning_rate": 0.5}})
    assert [k.key for k in ignored_keys(idle, "ddp")] == ["training.outer_learning_rate"]


@pytest.mark.parametrize("sections, fragment", [
    ({"training": {"sync_every": 4, "precision": "fp16"}}, "training.precision: fp16 loss scaling"),
    ({"training": {"sync_every": 4}, "system": {"balance": "proportional"}}, "system.balance: proportional"),
])
def test_ddp_refuses_what_local_updates_do_not_offer(sections, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_supported(config_from_dict(sections))


@pytest.mark.parametrize("sections, fragment", [
    ({"training": {"sync_every": 4}, "ps": {"aggregation_mode": "async"}},
     "ps.aggregation_mode: async is not offered with local updates"),
    ({"training": {"local_updates": True}, "ps": {"aggregation_mode": "ssp"}},
     "ps.aggregation_mode: ssp is not offered with local updates"),
    ({"training": {"sync_every": 4}, "system": {"balance": "proportional"}}, "system.balance: proportional"),
    ({"training": {"sync_every": 4, "precision": "fp16"}}, "training.precision: fp16"),
    ({"training": {"sync_every": 4}, "compression": {"pull": "topk"}},
     "compression.pull: topk is not offered with local updates"),
])
def test_the_parameter_server_refuses_what_local_updates_do_not_offer(sections, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        check_ps_supported(config_from_dict(sections))
    assert "\n" not in str(info.value)


def test_a_shard_steps_the_outer_optimizer_under_local_updates():
    config = config_from_dict({"training": {"sync_every": 4, "optimizer": "adamw", "weight_decay": 0.1,
                                            "clip_grad_norm": 1.0, "lr_schedule": "cosine",
                                            "lr_decay_steps": 10, "outer_optimizer": "nesterov",
                                            "outer_learning_rate": 0.7, "outer_momentum": 0.9}})
    model = torch.nn.Linear(3, 2)
    param = torch.nn.Parameter(torch.zeros(8))
    shard = ShardOptimizer(param, plan_shards(model, 1)[0], config.training, 8)
    (group,) = shard.optimizer.param_groups
    assert isinstance(shard.optimizer, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    assert not shard.changes_gradient and not shard.decayed and shard.schedule.constant
    reference = torch.nn.Parameter(torch.zeros(8))
    torch_sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for value in (1.0, -0.5, 2.0):  # the outer momentum carries over the rounds
        param.grad = torch.full((8,), value)
        reference.grad = param.grad.clone()
        shard.set_rate()
        shard.prepare(param.grad)
        shard.optimizer.step()
        shard.applied()
        torch_sgd.step()
    torch.testing.assert_close(param.detach(), reference.detach(), rtol=0, atol=1e-7)


def test_round_ends_are_the_blocks_the_ledgers_hold():
    # 10 batches an epoch, H = 4: rounds end at batches 3, 7 and the epoch's last, 9.
    assert [round_end(i, 10, 4) for i in range(10)] == [3, 3, 3, 3, 7, 7, 7, 7, 9, 9]
    assert [round_end(i, 3, 1) for i in range(3)] == [0, 1, 2]


def params_of(*values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(v) for v in values]


def test_a_round_ends_after_h_steps_or_at_the_epochs_end():
    outer = OuterOptimizer(LocalUpdates(3), params_of([1.0]))
    assert [outer.end_of_step(False) for _ in range(3)] == [False, False, True]
    outer.step(torch.zeros(1))
    assert outer.end_of_step(True)  # an epoch's last step cuts the round short


@pytest.mark.parametrize("optimizer, momentum", [("sgd", 0.0), ("sgd", 0.5), ("nesterov", 0.9)])
def test_the_outer_step_is_torch_sgd_on_the_averaged_pseudo_gradient(optimizer, momentum):
    settings = LocalUpdates(2, optimizer, 0.7, momentum)
    start = params_of([1.0, 2.0, 3.0], [[0.5, -0.5]])
    outer = OuterOptimizer(settings, start)
    reference = [p.clone().requires_grad_() for p in start]
    torch_sgd = torch.optim.SGD(reference, lr=0.7, momentum=momentum, nesterov=optimizer == "nesterov")
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # three rounds: the momentum carries over
        workers = [[p + torch.randn(p.shape, generator=generator) for p in start] for _ in range(2)]
        deltas = [outer.pseudo_gradient(w).clone() for w in workers]
        outer.step((deltas[0] + deltas[1]) / 2)
        outer.copy_to(start)
        for i, param in enumerate(reference):
            param.grad = (sum(w[i] for w in workers) / 2 - param.detach()).neg()
        torch_sgd.step()
        for mine, theirs in zip(start, reference, strict=True):
            torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=1e-6)
    assert outer.rounds == 3


def test_sgd_at_rate_one_averages_the_workers():
    outer = OuterOptimizer(LocalUpdates(4), params_of([0.0, 0.0]))
    workers = [params_of([1.0, 2.0]), params_of([3.0, -2.0])]
    outer.step((outer.pseudo_gradient(workers[0]).clone() + outer.pseudo_gradient(workers[1])) / 2)
    model = params_of([9.0, 9.0])
    outer.copy_to(model)
    assert model[0].tolist() == [2.0, 0.0]


def test_state_round_trips_and_refuses_another_layout():
    settings = LocalUpdates(4, "nesterov", 0.7, 0.9)
    outer = OuterOptimizer(settings, params_of([1.0, 2.0]))
    outer.end_of_step(False)
    outer.step(torch.tensor([0.5, -0.5]))
    outer.end_of_step(False)
    state = outer.state_dict()
    copy = OuterOptimizer(settings, params_of([0.0, 0.0]))
    copy.load_state_dict(state)
    assert (copy.steps_in_round, copy.rounds) == (1, 1)
    assert torch.equal(copy.start, outer.start) and torch.equal(copy.buffer, outer.buffer)
    with pytest.raises(ValueError, match="hold 2 values and this model 3"):
        OuterOptimizer(settings, params_of([0.0, 0.0, 0.0])).load_state_dict(state)
    with pytest.raises(ValueError, match="outer_momentum"):
        OuterOptimizer(LocalUpdates(4), params_of([0.0, 0.0])).load_state_dict(state)


def test_a_workers_rounds_resume_mid_round_from_their_state():
    config = config_from_dict({"training": {"sync_every": 3, "optimizer": "sgd", "momentum": 0.5,
                                            "learning_rate": 0.1}})

    def worker():
        model = torch.nn.Linear(3, 2)
        flat, grads = flat_parameters(model)
        return model, flat, grads, WorkerRounds(LocalUpdates.of(config.training), model, flat, grads,
                                                config.training)

    def inner_step(model, grads, rounds, seed):
        generator = torch.Generator().manual_seed(seed)
        grads.zero_()
        model(torch.randn(4, 3, generator=generator)).square().sum().backward()
        return rounds.inner_step(4, ends_epoch=False)

    model, flat, grads, rounds = worker()
    rounds.open()
    start = flat.clone()
    assert not inner_step(model, grads, rounds, 0)
    saved = rounds.state_dict()
    assert not inner_step(model, grads, rounds, 1) and inner_step(model, grads, rounds, 2)
    expected = rounds.pseudo_gradient()
    torch.testing.assert_close(expected, start - flat)

    other_model, other_flat, other_grads, resumed = worker()  # another start: the state replaces it
    resumed.load_state_dict(saved)
    assert not resumed.opening and resumed.samples == 4
    assert not inner_step(other_model, other_grads, resumed, 1) and inner_step(other_model, other_grads,
                                                                               resumed, 2)
    torch.testing.assert_close(resumed.pseudo_gradient(), expected, rtol=0, atol=0)  # momentum kept too
    assert resumed.samples == 12 and resumed.round_number == 1
    resumed.close()
    assert resumed.opening and resumed.round_number == 2 and resumed.samples == 0
