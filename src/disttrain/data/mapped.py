"""Any map-style `torch.utils.data.Dataset` as the strategies read data: a batch is the
items of a list of sample indices, collated.

The sampler hands out indices and the data ledger records them, so any data set that can
return item `i` on demand works with both, and with exact mid-epoch resume: nothing of
the data set's own order or state is involved. The built-in sets keep their faster path
(`ArrayDataset`, `TextWindows`: one gather per batch); a user's data set comes through
`MappedDataset`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from disttrain.data.batching import Batch, split_batch
from disttrain.data.description import DatasetDescription

SUBSET_SEED = 0  # the subsets of max_*_samples are the same whatever the training seed


class BatchedDataset(Protocol):
    """What a strategy needs of a data set: its length and a batch by sample indices."""

    name: str

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def subset(self, limit: int | None) -> BatchedDataset: ...


def subset_indices(length: int, limit: int | None) -> torch.Tensor | None:
    """The first `limit` indices of a fixed permutation of `length` (None: keep all)."""
    if limit is None or limit >= length:
        return None
    order = torch.randperm(length, generator=torch.Generator().manual_seed(SUBSET_SEED))
    return order[:limit]


class MappedDataset:
    """A map-style data set whose item `i` is `(input, target)` or a mapping of fields,
    batched by collating items (see `batching`).

    Args:
        dataset: anything with `__len__` and `__getitem__(i)` returning (input, target) or a
            mapping of fields.
        description: its task and shapes (for the model factory and the loss).
        indices: the items of `dataset` this one holds, in order (a subset), or all.
        collate: makes a batch of a list of items (torch's default collation by default).
        target_key: the field of mapping items that holds the targets.
    """

    def __init__(self, name: str, dataset: Any, description: DatasetDescription,
                 indices: torch.Tensor | None = None, collate: Callable[[list[Any]], Any] | None = None,
                 target_key: str = "labels"):
        self.name = name
        self.dataset = dataset
        self.description = description
        self.indices = indices
        self.collate = collate
        self.target_key = target_key

    def batched_by(self, collate: Callable[[list[Any]], Any] | None, target_key: str) -> MappedDataset:
        """This data set, its batches made by `collate` and split by `target_key`."""
        return MappedDataset(self.name, self.dataset, self.description, self.indices, collate, target_key)

    def __len__(self) -> int:
        return len(self.dataset) if self.indices is None else len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(index) if self.indices is None else int(self.indices[index])]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.description.input_shape

    @property
    def num_classes(self) -> int:
        return self.description.num_classes

    def batch(self, indices: torch.Tensor) -> Batch:
        """(inputs, targets) of the items at `indices`: inputs a tensor, or a mapping of
        tensors (the fields of mapping items but the targets)."""
        items = [self[int(i)] for i in indices]
        collated = (self.collate or default_collate)(items)
        return split_batch(collated, self.target_key, f"a batch of {self.name}")

    def subset(self, limit: int | None) -> MappedDataset:
        """The first `limit` items of a fixed permutation (deterministic), or self."""
        keep = subset_indices(len(self), limit)
        if keep is None:
            return self
        base = keep if self.indices is None else self.indices[keep]
        return MappedDataset(self.name, self.dataset, self.description, base, self.collate, self.target_key)
