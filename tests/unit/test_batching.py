"""How a user's items become a batch (`data.batching`): pairs and `datasets`-style rows of
fields, padded to the batch's longest (inputs with 0, targets with -100) with every value
kept, split into keyword inputs and targets; and what a step minimises (`Objective`):
the task's cross-entropy with padding left out, the model's own loss given `labels=`, or
a user's function."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.core.errors import ConfigError
from disttrain.data.batching import IGNORE_INDEX, pad_collate, split_batch
from disttrain.training.engine import (
    ModelOutputError,
    Objective,
    count_correct,
    evaluate,
    forward_backward,
    num_predictions,
    set_objective,
    task_loss,
)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.booleans())
def test_padding_keeps_every_value_and_fills_the_rest(lengths, as_rows):
    tokens = [torch.arange(1, n + 1) * (i + 1) for i, n in enumerate(lengths)]
    targets = [t + 100 for t in tokens]
    pairs = list(zip(tokens, targets, strict=True))
    rows = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y} for x, y in pairs]
    items = rows if as_rows else pairs
    inputs, padded_targets = split_batch(pad_collate(items))
    ids = inputs["input_ids"] if as_rows else inputs
    assert ids.shape == padded_targets.shape == (len(lengths), max(lengths))
    for row, n in enumerate(lengths):
        assert torch.equal(ids[row, :n], tokens[row]) and torch.equal(padded_targets[row, :n], targets[row])
        assert (ids[row, n:] == 0).all() and (padded_targets[row, n:] == IGNORE_INDEX).all()
        if as_rows:
            assert inputs["attention_mask"][row].sum() == n


def test_rows_of_equal_length_and_scalar_labels_collate_as_torch_does():
    rows = [{"input_ids": torch.tensor([1, 2]), "label": 1}, {"input_ids": torch.tensor([3, 4]), "label": 0}]
    inputs, targets = split_batch(pad_collate(rows, "labels"))  # "label" stands in for the absent "labels"
    assert torch.equal(inputs["input_ids"], torch.tensor([[1, 2], [3, 4]]))
    assert torch.equal(targets, torch.tensor([1, 0]))


def test_a_batch_without_its_target_key_or_of_another_kind_is_one_line():
    with pytest.raises(ConfigError, match=r"^training.target_key: the batch has the fields "
                                          r"\['input_ids', 'y'\], and none is 'labels'; set "):
        split_batch({"input_ids": torch.zeros(2, 3), "y": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"^training.collate_fn: the batch is a Tensor; a batch is a pair"):
        split_batch(torch.zeros(3))
    inputs, targets = split_batch({"text": torch.zeros(2, 3), "y": torch.ones(2)}, "y")
    assert list(inputs) == ["text"] and torch.equal(targets, torch.ones(2))


def test_padding_counts_in_neither_the_loss_nor_the_accuracy():
    logits = torch.tensor([[[5.0, 0.0], [0.0, 5.0], [9.0, 0.0]]])
    targets = torch.tensor([[0, 1, IGNORE_INDEX]])
    assert count_correct(logits, targets) == 2 and num_predictions(targets) == 2
    assert task_loss(logits, targets) == pytest.approx(task_loss(logits[:, :2], targets[:, :2]))


class Output(OrderedDict):
    def __getattr__(self, name):
        return self[name]


class OwnLoss(torch.nn.Module):
    """A classifier of keyword inputs that computes its loss itself, given labels (as
    Hugging Face models do): three times the cross-entropy, to tell it from the task's."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def forward(self, features, labels=None):
        logits = self.layer(features)
        output = Output(logits=logits)
        if labels is not None:
            output["loss"] = 3 * torch.nn.functional.cross_entropy(logits, labels)
        return output


def test_each_objective_is_what_the_step_minimises_and_the_evaluation_reports():
    inputs, targets = {"features": torch.randn(6, 4)}, torch.tensor([0, 1, 2, 0, 1, 2])
    model = OwnLoss()
    task = task_loss(model(**inputs).logits, targets).item()
    mine = Objective("mine", lambda output, t: 5 * task_loss(output.logits, t))
    for objective, expected in ((Objective(), task), (Objective("model"), 3 * task), (mine, 5 * task)):
        set_objective(model, objective)
        assert forward_backward(model, inputs, targets).loss == pytest.approx(expected, rel=1e-5)
        rows = type("Rows", (), {"__len__": lambda self: 6, "batch": lambda self, i: (
            {"features": inputs["features"][i]}, targets[i])})()
        assert evaluate(model, rows).loss == pytest.approx(expected, rel=1e-5)


def test_a_model_without_its_own_loss_or_a_loss_function_without_a_scalar_is_named():
    model = set_objective(OwnLoss(), Objective("model"))
    with pytest.raises(ModelOutputError, match="training.loss=model: the model's forward, given labels=..., "
                                               "returned no `loss`"):
        Objective("model").loss(Output(logits=torch.zeros(2, 3)), torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ModelOutputError, match=r"training.loss: mine returned a tensor \(2,\), not a scalar"):
        Objective("mine", lambda output, t: torch.zeros(2)).loss(None, torch.zeros(2, 3), torch.zeros(2))
    assert forward_backward(model, {"features": torch.randn(2, 4)}, torch.tensor([0, 1])).num_samples == 2
