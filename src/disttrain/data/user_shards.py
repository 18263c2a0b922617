"""A user's data set read by shards: an iterable data set of the user's own that lists its
shards up front, trained with the same position rule as every other data set.

A data-set factory (`PATH.py:NAME`, `module:NAME`, an entry point) may return, for either
split, an object (a `torch.utils.data.IterableDataset` or any other) with

- `shards`: a sequence of anything that names a shard (file names, URLs, numbers);
- `read_shard(shard)`: that shard's items, as a sequence, in a fixed order (each item a
  pair `(input, target)` or a mapping of fields, as a map-style set's);
- optionally `shard_sizes`: the number of items of each shard; without it every shard is
  read once, at the start, to count them.

It becomes a map-style view (`UserShards`): item `i` is item `i - start(s)` of shard `s`,
read through a `ShardReader` (at most `training.num_shards_in_memory` shards held, the next
`training.num_shards_ahead` of this process's order read ahead by a thread). The sampler
orders it shard by shard (`data.shard_order`), so each process reads its shards whole, and
its position in that order (epoch, offset, the shards' sizes) is what checkpoints record:
a resume goes on at the next item of the shard it stopped in, nothing repeated or skipped.
An iterable data set that lists no shards has no position to record, and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disttrain.core.errors import ConfigError, DataError
from disttrain.data.shard_order import shard_starts
from disttrain.data.shard_reader import ReaderLimits, ShardContents, ShardFiles, ShardReader


def lists_shards(data: Any) -> bool:
    """Whether `data` lists its shards up front (`shards` and `read_shard`)."""
    return hasattr(data, "shards") and callable(getattr(data, "read_shard", None))


def refuse_plain_iterable(data: Any, where: str) -> None:
    """Refuse an iterable data set (no `__getitem__`) that lists no shards, in one line.

    Raises:
        ConfigError: naming what to provide.
    """
    iterable = isinstance(data, torch.utils.data.IterableDataset) or (
        hasattr(data, "__iter__") and not hasattr(data, "__getitem__"))
    if iterable and not lists_shards(data):
        raise ConfigError(f"training.dataset: {where} is an iterable data set with no listed shards, so "
                          "its position cannot be checkpointed; give it `shards` (a list) and "
                          "`read_shard(shard)` returning that shard's items (and `shard_sizes` to skip "
                          "counting them), or make it map-style (__len__ and __getitem__)")


class UserShards:
    """The map-style view of a user's data set that lists its shards.

    Raises (constructing):
        ConfigError: `shards` is empty, `shard_sizes` does not match it, or a shard is empty.
    """

    def __init__(self, name: str, source: Any, limits: ReaderLimits):
        self.name, self.source = name, source
        shards = list(source.shards)
        if not shards:
            raise ConfigError(f"training.dataset: {name} lists no shards")
        self.reader = ShardReader(ShardFiles(name, tuple(str(s) for s in shards)), "", False, limits,
                                  ShardContents(read=_ShardItems(source, shards)))
        sizes = getattr(source, "shard_sizes", None)
        if sizes is None:
            sizes = [len(self.reader.arrays(number)) for number in range(len(shards))]
        sizes = [int(n) for n in sizes]
        if len(sizes) != len(shards) or min(sizes) < 1:
            raise ConfigError(f"training.dataset: {name} lists {len(shards)} shards and {len(sizes)} sizes "
                              f"{sizes[:8]}; give one positive size a shard")
        self.shard_sizes: tuple[int, ...] = tuple(sizes)
        self.starts = shard_starts(sizes)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> Any:
        shard = int(torch.searchsorted(self.starts, torch.tensor(int(index)), right=True)) - 1
        self.reader.touched([shard])
        items = self.reader.arrays(shard)
        offset = int(index) - int(self.starts[shard])
        if len(items) <= offset:
            raise DataError(f"training.dataset: {self.name}'s shard {self.reader.files[shard]} gave "
                            f"{len(items)} items, its size says {self.shard_sizes[shard]}; read_shard must "
                            "give each shard's items alike every time")
        return items[offset]

    def read_ahead(self, batches: list[torch.Tensor]) -> None:
        """Tell the reader the batches this process will read next, in order."""
        if batches:
            shards = torch.searchsorted(self.starts, torch.cat(batches), right=True) - 1
            self.reader.plan(shards.tolist())


class _ShardItems:
    """`read_shard` of the user's object by shard number, as a sequence (picklable when the
    user's object is)."""

    def __init__(self, source: Any, shards: Sequence[Any]):
        self.source, self.shards = source, list(shards)

    def __call__(self, number: int) -> Sequence[Any]:
        items = self.source.read_shard(self.shards[number])
        return items if isinstance(items, Sequence) else list(items)
