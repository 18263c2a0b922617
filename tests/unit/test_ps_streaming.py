"""Streaming DiLoCo on a parameter-server worker, without processes: fragments are groups
of whole shards, each fragment's rounds end at its own steps (and its shards' ledgers
hold one block per round of its own), a push carries the due fragments' pseudo-gradients
in their places with their shards' steps and samples, the servers' outer result opens
the next round (mixed with the worker's own), and F = 1 is plain local updates."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.strategies.ps.wire.sharding import flat_parameters
from disttrain.strategies.ps.worker.local_rounds import WorkerRounds, round_end, round_start, shard_groups
from disttrain.training.fragments import StreamingRounds, pieces_between, split_fragments
from disttrain.training.local_updates import LocalUpdates


def test_shards_are_grouped_into_fragments_of_about_equal_elements():
    assert shard_groups([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert shard_groups([10, 10, 10, 10], 4) == [[0], [1], [2], [3]]
    assert shard_groups([30, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    assert shard_groups([1, 1, 100], 3) == [[0], [1], [2]]  # never an empty group
    assert shard_groups([5, 5, 5], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="use ps.num_servers >= 3"):
        shard_groups([5, 5], 3)


def test_a_fragments_rounds_end_at_its_offset_and_the_epochs_end():
    # H = 4, 10 batches: offset 0 ends at batches 3, 7, 9; offset 2 at 1, 5, 9.
    assert [round_end(i, 10, 4) for i in range(10)] == [3, 3, 3, 3, 7, 7, 7, 7, 9, 9]
    assert [round_end(i, 10, 4, 2) for i in range(10)] == [1, 1, 5, 5, 5, 5, 9, 9, 9, 9]
    assert [round_start(i, 4, 2) for i in range(10)] == [0, 0, 2, 2, 2, 2, 6, 6, 6, 6]
    assert [round_start(i, 4) for i in range(10)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]


def test_fragments_at_given_cuts_are_the_split_fragments_when_the_cuts_agree():
    sizes = [6, 20, 4]
    assert pieces_between(sizes, [0, 15, 30]) == split_fragments(sizes, 2)
    with pytest.raises(ValueError, match="do not ascend from 0 to the 30"):
        pieces_between(sizes, [0, 31])
    params = [torch.zeros(n) for n in sizes]
    rounds = StreamingRounds(LocalUpdates(4, num_fragments=2), params, cuts=[0, 10, 30])
    assert [f.names for f in rounds.fragments] == [["p0", "p1[0:4]"], ["p1[4:20]", "p2"]]
    with pytest.raises(ValueError, match="3 cuts make 2 fragment"):
        StreamingRounds(LocalUpdates(4, num_fragments=3), params, cuts=[0, 10, 30])


def test_an_outer_result_from_the_transport_opens_the_next_round_mixed():
    param = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rounds = StreamingRounds(LocalUpdates(2, num_fragments=2, mixing=0.25), [param], cuts=[0, 2, 4])
    param.add_(1.0)  # the worker's own steps
    (fragment,) = rounds.end_of_step(ends_epoch=False)  # fragment 1 (offset 1) ends at step 1
    assert fragment.index == 1
    own = param[2:].clone()
    param[2:] = torch.tensor([10.0, 20.0])  # the transport pulled the outer result over them
    rounds.take_outer(fragment, param[2:].clone(), ends_epoch=False, own=own)
    torch.testing.assert_close(fragment.outer.start, torch.tensor([10.0, 20.0]))
    torch.testing.assert_close(param, torch.tensor([2.0, 3.0, 0.25 * 4 + 0.75 * 10, 0.25 * 5 + 0.75 * 20]))
    assert (fragment.outer.rounds, fragment.outer.steps_in_round) == (1, 0)
    assert rounds.fragments[0].outer.steps_in_round == 1  # fragment 0's round goes on


CONFIG = config_from_dict({"training": {"sync_every": 4, "optimizer": "sgd", "learning_rate": 0.1,
                                        "outer_fragments": 2}})


def worker(num_fragments: int = 2, shards=(5, 5, 10)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 4))  # 8 + 12 values
    flat, grads = flat_parameters(model)
    settings = LocalUpdates(4, num_fragments=num_fragments)
    return model, flat, grads, WorkerRounds(settings, model, flat, grads, CONFIG.training, list(shards))


def inner_step(model, grads, rounds, seed, ends_epoch=False, num_samples=4):
    generator = torch.Generator().manual_seed(seed)
    grads.zero_()
    model(torch.randn(num_samples, 3, generator=generator)).square().sum().backward()
    return rounds.inner_step(num_samples, ends_epoch)


def test_a_push_carries_the_due_fragments_values_with_their_shards_steps_and_samples():
    model, flat, grads, rounds = worker()
    assert rounds.groups == [[0, 1], [2]] and rounds.cuts == [0, 10, 20]
    start = flat.clone()
    assert rounds.opening and not inner_step(model, grads, rounds, 0)
    assert inner_step(model, grads, rounds, 1)  # step 2: fragment 1 (offset 2)
    assert [f.index for f in rounds.due] == [1] and rounds.due_shards == [2]
    assert rounds.shard_steps() == [1, 1, 1] and rounds.shard_samples() == [8, 8, 8]
    grads.fill_(7.0)
    pushed = rounds.pseudo_gradient()
    torch.testing.assert_close(pushed[10:], start[10:] - flat[10:], rtol=0, atol=0)
    assert torch.equal(pushed[:10], torch.full((10,), 7.0))  # fragment 0's place is not sent
    flat[10:] = 0.5  # the shards' outer result, pulled
    rounds.close()
    assert rounds.shard_steps() == [1, 1, 2] and rounds.shard_samples() == [8, 8, 0]
    assert rounds.scalars()["local/rounds"] == 0  # fragment 0 has not ended a round yet
    assert not inner_step(model, grads, rounds, 2) and inner_step(model, grads, rounds, 3)  # step 4
    assert [f.index for f in rounds.due] == [0] and rounds.due_shards == [0, 1]
    assert rounds.shard_samples() == [16, 16, 8]
    assert rounds.last_push(2) == 1 and rounds.last_push(0) == 0


def test_an_epochs_end_pushes_every_fragment_and_a_resumed_worker_goes_on_alike():
    model, flat, grads, rounds = worker()
    inner_step(model, grads, rounds, 0)
    saved = rounds.state_dict()
    assert saved["samples"] == [4, 4]
    assert inner_step(model, grads, rounds, 1, ends_epoch=True)
    assert [f.index for f in rounds.due] == [0, 1] and rounds.due_shards == [0, 1, 2]
    expected = rounds.pseudo_gradient()
    rounds.close()
    assert rounds.opening and rounds.scalars()["local/rounds"] == 1

    other_model, _, other_grads, resumed = worker()
    resumed.load_state_dict(saved)
    assert inner_step(other_model, other_grads, resumed, 1, ends_epoch=True)
    assert torch.equal(resumed.pseudo_gradient(), expected)
    with pytest.raises(ValueError, match="written with training.outer_fragments=2"):
        worker(num_fragments=1)[3].load_state_dict(saved)


def test_one_fragment_is_plain_local_updates():
    model, flat, grads, rounds = worker(num_fragments=1)
    assert rounds.groups == [[0, 1, 2]] and rounds.round_number == 1
    start = flat.clone()
    for seed in range(3):
        assert not inner_step(model, grads, rounds, seed)
    assert inner_step(model, grads, rounds, 3) and rounds.due_shards == [0, 1, 2]
    torch.testing.assert_close(rounds.pseudo_gradient(), start - flat, rtol=0, atol=0)
    assert rounds.state_dict()["samples"] == 16  # one fragment: the state as before fragments
    rounds.close()
    assert rounds.round_number == 2 and rounds.shard_steps() == [2, 2, 2]


def test_fragments_refuse_a_model_with_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    flat, grads = flat_parameters(model)
    with pytest.raises(ValueError, match="models without buffers"):
        WorkerRounds(LocalUpdates(4, num_fragments=2), model, flat, grads, CONFIG.training, [8, 8])
