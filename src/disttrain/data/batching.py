"""How the items of a user's data set become one batch: collated (torch's default, padded,
or the user's own `collate_fn`), then split into the model's inputs and the targets.

An item is a pair `(input, target)` or a mapping of named fields, as the `datasets`
library's rows are (`{"input_ids": ..., "attention_mask": ..., "labels": ...}`). A batch
of pairs is `(inputs, targets)`; a batch of mappings keeps its fields apart: the targets
are the field `training.target_key` ("labels", or "label" when there is no "labels"),
and the inputs are the other tensor fields, which the model's forward takes as keyword
arguments (`model(**inputs)`, as Hugging Face models take them).

`pad` collation pads every field whose items differ in length (their first dimension) to
the batch's longest: inputs with 0, targets with -100, the index the loss and the
accuracy leave out (an `attention_mask` padded with 0 masks the padding, as it should).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from disttrain.core.errors import ConfigError

# The target of a position the loss and the accuracy leave out (torch's cross-entropy default).
IGNORE_INDEX = -100
TARGET_KEYS = ("labels", "label")  # the default target key, and the one tried when it is absent

Batch = tuple[Any, torch.Tensor]  # (a tensor, or a mapping of name -> tensor), targets
Collate = Callable[[list[Any]], Any]


def pad_collate(items: list[Any], target_key: str = "labels") -> Any:
    """torch's default collation, but fields whose items differ in length are padded to
    the longest: inputs with 0, the targets (`target_key` of mappings, the second of
    pairs) with `IGNORE_INDEX`."""
    if not items:
        return default_collate(items)
    first = items[0]
    if isinstance(first, Mapping):
        return {key: _padded([item[key] for item in items], IGNORE_INDEX if key == target_key else 0)
                for key in first}
    if isinstance(first, Sequence) and len(first) == 2 and not isinstance(first, str):
        return (_padded([item[0] for item in items], 0), _padded([item[1] for item in items], IGNORE_INDEX))
    return default_collate(items)


def _padded(values: list[Any], fill: int) -> Any:
    tensors = [torch.as_tensor(v) if not isinstance(v, torch.Tensor) else v for v in values]
    if any(t.dim() == 0 for t in tensors) or len({t.shape for t in tensors}) == 1:
        return default_collate(values)
    longest = max(t.shape[0] for t in tensors)
    out = tensors[0].new_full((len(tensors), longest, *tensors[0].shape[1:]), fill)
    for row, t in enumerate(tensors):
        out[row, :t.shape[0]] = t
    return out


def split_batch(collated: Any, target_key: str = "labels", where: str = "the batch") -> Batch:
    """(inputs, targets) of a collated batch: a pair as it is; a mapping's `target_key`
    (or "label" when the default "labels" is absent) as the targets and its other tensor
    fields as the inputs.

    Raises:
        ConfigError: a mapping without the target key, or a batch of another kind.
    """
    if isinstance(collated, Mapping):
        key = target_key
        if key not in collated and target_key == TARGET_KEYS[0] and TARGET_KEYS[1] in collated:
            key = TARGET_KEYS[1]
        if key not in collated:
            raise ConfigError(f"training.target_key: {where} has the fields {sorted(map(str, collated))}, "
                              f"and none is {target_key!r}; set training.target_key to the field that holds "
                              "the targets")
        inputs = {str(k): v for k, v in collated.items() if k != key and isinstance(v, torch.Tensor)}
        if not inputs:
            raise ConfigError(f"training.target_key: {where} has no tensor field but the targets "
                              f"{key!r}; its fields are {sorted(map(str, collated))}")
        return inputs, torch.as_tensor(collated[key])
    if isinstance(collated, Sequence) and len(collated) == 2 and not isinstance(collated, str):
        inputs, targets = collated
        if isinstance(inputs, Mapping):
            return {str(k): torch.as_tensor(v) for k, v in inputs.items()}, torch.as_tensor(targets)
        return torch.as_tensor(inputs), torch.as_tensor(targets)
    raise ConfigError(f"training.collate_fn: {where} is a {type(collated).__name__}; a batch is a pair "
                      "(inputs, targets) or a mapping of fields with the targets under training.target_key")
