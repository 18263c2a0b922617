"""A model and data set shaped as Hugging Face's are, written as a user would into a file
of their own, with no dependency but torch: items are `datasets`-style rows of named
fields (`input_ids` of 3 to 9 tokens, an `attention_mask`, a `labels` class), so a batch
needs padding; the model's forward takes the fields as keyword arguments and returns an
output object (a mapping with attributes, as `ModelOutput` is) holding its logits, and
its own loss when given `labels=`. The label says whether token 7 is among the tokens:
learnable by a masked mean of embeddings, which padding does not change."""

from __future__ import annotations

from pathlib import Path

FIELDS_SOURCE = '''
from collections import OrderedDict

import torch
from torch import nn


class Rows(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(count):
            length = int(torch.randint(3, 10, (1,), generator=generator))
            ids = torch.randint(0, 16, (length,), generator=generator)
            self.rows.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long),
                              "labels": int((ids == 7).any())})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def data(num_train=256):
    return Rows(num_train, 0), Rows(64, 1), {"task": "classification", "input_shape": [9], "num_classes": 2}


class Output(OrderedDict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


class Classifier(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.embed, self.head = nn.Embedding(16, width), nn.Linear(width, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        logits = self.head(pooled)
        output = Output(logits=logits)
        if labels is not None:
            output["loss"] = nn.functional.cross_entropy(logits, labels)
        return output


def model(description, width=8):
    return Classifier(width)


def doubled_loss(output, targets):
    return 2 * nn.functional.cross_entropy(output.logits, targets)
'''


def write_fields_plugin(folder: Path) -> Path:
    """Write the plug-in file into `folder`; returns its path."""
    path = folder / "rows.py"
    path.write_text(FIELDS_SOURCE)
    return path
