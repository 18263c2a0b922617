"""A user's model and data set, written as a user would into a file of their own, for the
plug-in tests: a small classifier on a learnable set of vectors (and the same with its
first layer frozen), and the factories that fail in each way the errors must name."""

from __future__ import annotations

from pathlib import Path

PLUGIN_SOURCE = '''
import torch
from torch import nn


class Vectors(torch.utils.data.Dataset):
    """A map-style data set: 8-vectors, labelled by the sign of their sum."""

    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 8, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], int(self.y[index])


def data(num_train=192):
    description = {"task": "classification", "input_shape": [8], "num_classes": 2}
    return Vectors(num_train, 0), Vectors(64, 1), description


def model(description, hidden=16):
    return nn.Sequential(nn.Linear(description.input_shape[0], hidden), nn.ReLU(),
                         nn.Linear(hidden, description.num_classes))


def partly_frozen(description, hidden=16):
    """`model` with its first layer frozen: random features a trained head reads."""
    net = model(description, hidden)
    net[0].requires_grad_(False)
    return net


class WithSpareHead(nn.Module):
    """`model` beside a second head the forward never uses (as a multi-task model trained
    on one of its tasks): its parameters take no gradient."""

    def __init__(self, description, hidden):
        super().__init__()
        self.net = model(description, hidden)
        self.spare = nn.Linear(description.input_shape[0], description.num_classes)

    def forward(self, x):
        return self.net(x)


def spare_head(description, hidden=16):
    return WithSpareHead(description, hidden)


def raises(description):
    raise RuntimeError("the factory says no")


def not_a_module(description):
    return "a string"


def frozen(description):
    layer = nn.Linear(8, 2)
    layer.requires_grad_(False)
    return layer


def integer_parameters(description):
    module = nn.Linear(8, 2)
    module.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    return module


def mixed_dtypes(description):
    return nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2).double())


def empty_data():
    return Vectors(0, 0), Vectors(4, 1), {"task": "classification", "input_shape": [8], "num_classes": 2}


def no_description():
    return Vectors(4, 0), Vectors(4, 1)

NOT_CALLABLE = 3
'''


def write_plugin(folder: Path, name: str = "my_plugin.py") -> Path:
    """The plug-in file, written into `folder`; its path."""
    path = folder / name
    path.write_text(PLUGIN_SOURCE)
    return path


def write_text(folder: Path, num_words: int = 2000) -> Path:
    """A UTF-8 text of repetitive English (and some non-ASCII), learnable in a few steps."""
    words = "the quick brown fox jumps over a lazy dog and runs far away from home — café".split()
    text = " ".join(words[(i * 7 + i // 5) % len(words)] for i in range(num_words))
    path = folder / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path
