"""What a model's forward may return (`logits_of`: a tensor, a tuple's first item, a
mapping's or an output object's `logits`), and the one real step every run takes before
it starts (`check_first_step`): each way a model and its data fail together is one line
naming what the model returned against what the data set gives, and the step leaves the
run's random streams as they were."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError, DataError
from disttrain.training.engine import ModelOutputError, forward_backward, logits_of
from disttrain.training.first_step import check_first_step, dry_run_step

MODELS = '''
import torch
from torch import nn
from collections import OrderedDict


class Output(OrderedDict):                       # as a Hugging Face ModelOutput: a mapping with attributes
    def __getattr__(self, name):
        return self[name]


class Net(nn.Module):
    def __init__(self, inputs, outputs, returns):
        super().__init__()
        self.flat, self.layer, self.returns = nn.Flatten(), nn.Linear(inputs, outputs), returns

    def forward(self, x):
        logits = self.layer(self.flat(x))
        if self.returns == "tuple":
            return logits, x
        if self.returns == "dict":
            return {"logits": logits, "hidden": x}
        if self.returns == "object":
            return Output(logits=logits)
        if self.returns == "text":
            return "logits"
        if self.returns == "ints":
            return logits.long()
        if self.returns == "flat":
            return logits.flatten()
        return logits


def model(description, inputs=64, outputs=None, returns="tensor"):
    return Net(inputs, outputs or description.num_classes, returns)


def broken(description):
    return BrokenNet()


class BrokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        widths = {}
        return self.layer(x.flatten(1)[:, :widths["classes"]])
'''

DATA = '''
import torch


class Ragged(torch.utils.data.Dataset):          # items of different lengths, no collate_fn
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(1 + i % 3), i % 2


def ragged():
    return Ragged(), Ragged(), {"task": "classification", "input_shape": [3], "num_classes": 2}
'''


@pytest.fixture
def files(tmp_path):
    (tmp_path / "nets.py").write_text(MODELS)
    (tmp_path / "ragged.py").write_text(DATA)
    return tmp_path


def training(files, factory="model", dataset="digits", **model_args) -> TrainingConfig:
    return TrainingConfig(model_architecture=f"{files / 'nets.py'}:{factory}", dataset=dataset,
                          model_args=model_args, batch_size=16, max_train_samples=64, max_test_samples=32)


class Output(OrderedDict):
    def __getattr__(self, name):
        return self[name]


def test_the_logits_are_taken_out_of_each_shape_a_forward_returns():
    logits = torch.randn(4, 3)
    for output in (logits, (logits, torch.zeros(1)), [logits], {"logits": logits, "loss": torch.zeros(())},
                   Output(logits=logits)):
        assert logits_of(output) is logits
    for output, said in (("x", "a str"), ((), "a tuple of 0 item(s), the first a nothing"),
                         (("x", logits), "a tuple of 2 item(s), the first a str"),
                         ({"scores": logits}, "a mapping with keys ['scores']"), (None, "a NoneType")):
        with pytest.raises(ModelOutputError, match=f"^the model's forward returned {re.escape(said)}, "):
            logits_of(output)


@pytest.mark.parametrize("returns", ["tensor", "tuple", "dict", "object"])
def test_every_shape_of_output_trains_and_passes_the_first_step(files, returns):
    config = training(files, returns=returns)
    assert check_first_step(config).startswith("one step on a batch of 16: logits (16, 10), loss ")
    net = Returning(returns)
    result = forward_backward(net, torch.randn(5, 1, 8, 8), torch.arange(5))
    assert result.num_samples == 5 and net.layer.weight.grad is not None


class Returning(torch.nn.Module):
    """A classifier of 8x8 images whose forward returns its logits as `returns` says."""

    def __init__(self, returns):
        super().__init__()
        self.layer, self.returns = torch.nn.Linear(64, 10), returns

    def forward(self, x):
        logits = self.layer(x.flatten(1))
        return {"tensor": logits, "tuple": (logits, None), "dict": {"logits": logits},
                "object": Output(logits=logits)}[self.returns]


def test_the_first_step_leaves_the_runs_random_streams_as_they_were(files):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    check_first_step(training(files))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("args, line", [
    ({"inputs": 32}, r"nets\.py:model's forward failed on a batch of inputs \(16, 1, 8, 8\) float32 with 10 "
                     r"classes: RuntimeError: mat1 and mat2 shapes cannot be multiplied \(16x64 and 32x10\) "
                     r"\(at .*nets\.py:\d+, in forward\)$"),
    ({"outputs": 5}, r"nets\.py:model returned 5 scores per target for 10 classes; give its last layer 10 "
                     r"outputs$"),
    ({"returns": "text"}, r"nets\.py:model, given a batch of inputs \(16, 1, 8, 8\) float32 with 10 classes: "
                          r"the model's forward returned a str, which holds no logits; "),
    ({"returns": "ints"}, r"nets\.py:model returned logits of torch\.int64 for a batch .*; return float "
                          r"scores$"),
    ({"returns": "flat"}, r"nets\.py:model returned logits \(160,\) for a batch .*; the loss needs "
                          r"\(16, 10\) "),
])
def test_a_model_that_cannot_take_the_data_is_one_line_naming_both(files, args, line):
    with pytest.raises(ConfigError, match=r"^training\.model_architecture: .*" + line) as caught:
        check_first_step(training(files, **args))
    assert "\n" not in str(caught.value)


def test_a_bug_in_the_users_forward_names_its_file_and_line(files):
    with pytest.raises(ConfigError, match=r"nets\.py:broken's forward failed on .*: KeyError: 'classes' "
                                          r"\(at .*nets\.py:\d+, in forward\)$"):
        check_first_step(training(files, factory="broken"))


def test_items_that_cannot_be_batched_are_the_data_sets_line(files):
    config = TrainingConfig(model_architecture=f"{files / 'nets.py'}:model", model_args={"inputs": 3},
                            dataset=f"{files / 'ragged.py'}:ragged", batch_size=4)
    with pytest.raises(ConfigError, match=r"^training\.dataset: the first batch of .*ragged\.py:ragged "
                                          r"cannot be drawn: RuntimeError: .*equal size"):
        check_first_step(config)


def test_check_config_where_the_data_set_is_not_tries_no_step_and_says_so(tmp_path):
    config = TrainingConfig(dataset="mnist", data_dir=str(tmp_path / "data"), download=True)
    assert dry_run_step(config) == "no step tried: mnist cannot be read on this machine"
    assert list(tmp_path.iterdir()) == []  # nothing downloaded, no folder made
    config = replace(config, download=False)
    with pytest.raises(DataError):  # the run itself stops on it, as before
        check_first_step(config)
