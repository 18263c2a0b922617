"""A round redone by a parameter-server worker with local updates (a shard lost it, found
by `disttrain chaos`, ps-local seed 207), without processes: the redo trains the round's
batches as the worker's own round would from the same state, and leaves the worker's own
training as it was (model parameters and buffers, inner optimizer, schedule, round place),
so its next round is the one it would have taken without the redo."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.strategies.ps.wire.sharding import flat_parameters
from disttrain.strategies.ps.worker.local_rounds import WorkerRounds
from disttrain.training.local_updates import LocalUpdates

# AdamW (moments), a cosine schedule (its place moves the rate) and clipping (its norm
# is reported): every piece of the inner optimizer a redo could leave moved.
CONFIG = config_from_dict({"training": {
    "sync_every": 3, "optimizer": "adamw", "learning_rate": 0.05, "lr_schedule": "cosine",
    "lr_decay_steps": 40, "clip_grad_norm": 0.5}})


def worker(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    flat, grads = flat_parameters(model)
    return model, flat, grads, WorkerRounds(LocalUpdates.of(CONFIG.training), model, flat, grads,
                                            CONFIG.training)


def batch_step(model, grads, seed: int):
    """One batch's gradient into `grads` (what a worker's `compute` does)."""
    def step():
        generator = torch.Generator().manual_seed(seed)
        grads.zero_()
        model(torch.randn(8, 3, generator=generator)).square().mean().backward()
    return step


def train_round(model, grads, rounds, seeds):
    rounds.open()
    for i, seed in enumerate(seeds):
        batch_step(model, grads, seed)()
        ended = rounds.inner_step(8, ends_epoch=i == len(seeds) - 1)
    assert ended
    return rounds.pseudo_gradient()


def snapshot(model, rounds):
    """Everything of the worker's own training, copied."""
    state = rounds.state_dict()
    optimizer = {k: {n: v.clone() for n, v in s.items()} for k, s in state["optimizer"]["state"].items()}
    return {"params": state["params"], "buffers": [b.clone() for b in model.buffers()],
            "optimizer": optimizer,
            "lr": [g["lr"] for g in rounds.optimizer.param_groups], "schedule": state["schedule"],
            "outer": state["outer"], "samples": state["samples"], "grad_norm": rounds.stepper.last_grad_norm,
            "opening": rounds.opening, "round_number": rounds.round_number}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_redone_round_is_the_round_and_leaves_the_workers_own_training_as_it_was():
    model, flat, grads, rounds = worker()
    train_round(model, grads, rounds, [1, 2, 3])
    rounds.close()  # an epoch's end: the round pushed, the next one not opened yet
    before = snapshot(model, rounds)
    assert before["optimizer"] and before["schedule"]["num_steps"] == 3 and before["round_number"] == 2

    # The same worker that never redid a round: its round of these batches is the reference.
    reference_model, _, reference_grads, reference = worker(seed=1)
    reference.load_state_dict(rounds.state_dict())
    for buffer, value in zip(reference_model.buffers(), model.buffers(), strict=True):
        buffer.copy_(value)
    expected = train_round(reference_model, reference_grads, reference, [7, 8, 9])

    with rounds.aside():
        rounds.redo([batch_step(model, grads, seed) for seed in (7, 8, 9)])
        moved = snapshot(model, rounds)
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)
    assert not torch.equal(moved["params"], before["params"]) and moved["schedule"] != before["schedule"]
    assert not torch.equal(moved["buffers"][0], before["buffers"][0])  # BatchNorm's running mean

    assert_same(snapshot(model, rounds), before)

    # The next round is the one the worker would have taken without the redo.
    untouched_model, _, untouched_grads, untouched = worker(seed=2)
    untouched.load_state_dict(rounds.state_dict())
    for buffer, value in zip(untouched_model.buffers(), model.buffers(), strict=True):
        buffer.copy_(value)
    torch.testing.assert_close(train_round(model, grads, rounds, [4, 5, 6]),
                               train_round(untouched_model, untouched_grads, untouched, [4, 5, 6]),
                               rtol=0, atol=0)


def test_a_redo_that_fails_still_leaves_the_workers_own_training_as_it_was():
    model, flat, grads, rounds = worker()
    train_round(model, grads, rounds, [1, 2])
    rounds.close()
    before = snapshot(model, rounds)

    def broken():
        raise RuntimeError("the data loader died")

    with pytest.raises(RuntimeError, match="loader"), rounds.aside():
        rounds.redo([batch_step(model, grads, 3), broken])
    assert_same(snapshot(model, rounds), before)
