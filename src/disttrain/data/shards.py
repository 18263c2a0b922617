"""`shards:URL`: a data set of array shards in a folder (a local path or any fsspec URL),
larger than memory, read shard by shard as training reaches it.

The folder holds `.npz` shards (numpy's format, read without pickle: a shard cannot run
code) and `index.json`, which lists each split's shards and their lengths, so the data
set's length, and the shard of every index, are known before any shard is read:

    {"format": "disttrain-shards", "version": 1, "inputs": "x", "targets": "y",
     "description": {"task": "classification", "input_shape": [1, 8, 8], "num_classes": 10},
     "train": [{"file": "train-00000.npz", "num_samples": 256}, ...],
     "test": [{"file": "test-00000.npz", "num_samples": 256}, ...]}

Every shard holds the arrays `inputs` and `targets`, of one length (a sample per row).
`write_shards` writes such a folder from arrays. Sample `i` of a split is row
`i - start(s)` of its shard `s` (shards in the index's order). The sampler orders each
epoch shard by shard (`data.shard_order`), so a process reads its shards whole, a few at
a time (`data.shard_reader`: disk cache, memory and read-ahead bounds). A language-model
data set's inputs and targets are token ids (int64); a classification set's inputs are
read as float32 and its targets as int64.

`training.max_train_samples` keeps the first samples in the index's order (whole shards,
then part of one), so a subset reads fewer shards too.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disttrain.config import TrainingConfig
from disttrain.core import object_store
from disttrain.core.errors import DataError
from disttrain.data import store_cache, text
from disttrain.data.description import LANGUAGE_MODEL, DatasetDescription
from disttrain.data.shard_order import shard_starts
from disttrain.data.shard_reader import ReaderLimits, ShardFiles, ShardReader

PREFIX = "shards:"
INDEX = "index.json"
FORMAT = "disttrain-shards"
VERSION = 1
SPLITS = ("train", "test")


@dataclass(frozen=True)
class ShardIndex:
    """What `index.json` says: the arrays' names, the description, each split's shards."""

    inputs: str
    targets: str
    description: DatasetDescription
    splits: dict[str, list[tuple[str, int]]]  # split -> [(file, num_samples)]


def parse_index(text: bytes | str, where: str) -> ShardIndex:
    """The index of a shard folder, checked.

    Raises:
        DataError: not JSON, not this format or version, or a field missing or wrong.
    """
    try:
        raw = json.loads(text)
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}, not {FORMAT!r} "
                             f"version {VERSION}")
        description = DatasetDescription.coerce(raw["description"], where)
        splits = {}
        for split in SPLITS:
            shards = [(str(s["file"]), int(s["num_samples"])) for s in raw[split]]
            if not shards or min(n for _, n in shards) < 1:
                raise ValueError(f"its {split} split lists no shards, or a shard of no samples")
            for file, _ in shards:
                if "/" in file or file in ("", ".", ".."):
                    raise ValueError(f"shard {file!r} is no file name in the folder")
            splits[split] = shards
        return ShardIndex(str(raw.get("inputs", "x")), str(raw.get("targets", "y")), description, splits)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"training.dataset: {where} is not a shard index ({type(e).__name__}: {e}); write "
                        "the folder with disttrain.data.shards.write_shards") from e


Split = tuple[np.ndarray, np.ndarray]  # (inputs, targets)


@dataclass(frozen=True)
class ArrayNames:
    """The names a shard's `.npz` gives its inputs and its targets (the index records them)."""

    inputs: str = "x"
    targets: str = "y"


def write_shards(location: str | Path, train: Split, test: Split, samples_per_shard: int,
                 description: DatasetDescription | dict[str, Any] | None = None,
                 names: ArrayNames = ArrayNames()) -> str | Path:
    """Write `train` and `test` (inputs, targets) as `.npz` shards of `samples_per_shard`
    rows and their `index.json` into `location` (a local folder or any fsspec URL), the
    index last, so a reader never sees an index of shards not yet written.

    Args:
        description: the data set's task and shapes; by default classification of the
            inputs' row shape into `max(targets) + 1` classes.
        names: the arrays' names in each shard.

    Returns:
        The spec to train on: `shards:<location>`.

    Raises:
        ValueError: inputs and targets of different lengths, an empty split, or
            `samples_per_shard` < 1.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard {samples_per_shard} must be >= 1")
    if description is None:
        classes = int(max(np.max(train[1]), np.max(test[1]))) + 1
        description = DatasetDescription.classification(tuple(train[0].shape[1:]), classes)
    description = DatasetDescription.coerce(description, "write_shards")
    inputs, targets = names.inputs, names.targets
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "inputs": inputs, "targets": targets,
                             "description": _description_fields(description)}
    for split, (x, y) in (("train", train), ("test", test)):
        if len(x) != len(y) or not len(x):
            raise ValueError(f"the {split} split has {len(x)} inputs and {len(y)} targets; give as many, "
                             "and at least one")
        index[split] = []
        for number, start in enumerate(range(0, len(x), samples_per_shard)):
            file = f"{split}-{number:05d}.npz"
            buffer = io.BytesIO()
            np.savez(buffer, **{inputs: x[start:start + samples_per_shard],
                                targets: y[start:start + samples_per_shard]})
            object_store.write_bytes(object_store.join(location, file), buffer.getvalue())
            index[split].append({"file": file, "num_samples": len(x[start:start + samples_per_shard])})
    object_store.write_bytes(object_store.join(location, INDEX), json.dumps(index, indent=1).encode())
    return f"{PREFIX}{location}"


def write_text_shards(source: str | Path, location: str | Path, seq_len: int, samples_per_shard: int
                      ) -> str | Path:
    """Cut the text at `source` (a local path or any fsspec URL) into `text:FILE`'s windows
    of `seq_len` tokens (bytes) and write them as shards into `location`, reading the text
    one shard's bytes at a time (a corpus larger than memory): the same samples, the same
    last tenth held out for the test, as `text:FILE` makes of it, stored as bytes (uint8).

    Returns:
        The spec to train on: `shards:<location>`.

    Raises:
        ValueError: too little text for a train and a test window, or a bad size.
        OSError: the text cannot be read.
    """
    if seq_len < 1 or samples_per_shard < 1:
        raise ValueError(f"seq_len {seq_len} and samples_per_shard {samples_per_shard} must be >= 1")
    handle = _open_bytes(source)
    with handle:
        size = handle.seek(0, io.SEEK_END)
        num_windows = (size - 1) // seq_len
        if num_windows < 2:
            raise ValueError(f"{source} has {size} bytes, too few for a train and a test window of "
                             f"{seq_len}")
        num_test = max(1, int(num_windows * text.TEST_FRACTION))
        splits = {"train": range(0, num_windows - num_test),
                  "test": range(num_windows - num_test, num_windows)}
        index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "inputs": "x", "targets": "y",
                                 "description": _description_fields(text.describe_text(seq_len))}
        for split, windows in splits.items():
            index[split] = []
            for number, first in enumerate(range(windows.start, windows.stop, samples_per_shard)):
                count = min(samples_per_shard, windows.stop - first)
                handle.seek(first * seq_len)
                data = np.frombuffer(handle.read(count * seq_len + 1), dtype=np.uint8)
                rows = np.lib.stride_tricks.sliding_window_view(data, seq_len + 1)[::seq_len]
                file = f"{split}-{number:05d}.npz"
                buffer = io.BytesIO()
                np.savez(buffer, x=np.ascontiguousarray(rows[:, :-1]), y=np.ascontiguousarray(rows[:, 1:]))
                object_store.write_bytes(object_store.join(location, file), buffer.getvalue())
                index[split].append({"file": file, "num_samples": count})
    object_store.write_bytes(object_store.join(location, INDEX), json.dumps(index, indent=1).encode())
    return f"{PREFIX}{location}"


def _open_bytes(source: str | Path) -> Any:
    if object_store.is_url(source):
        import fsspec

        return fsspec.open(str(source), "rb").open()
    return Path(source).open("rb")


def _description_fields(description: DatasetDescription) -> dict[str, Any]:
    if description.task == LANGUAGE_MODEL:
        return {"task": LANGUAGE_MODEL, "vocab_size": description.vocab_size, "seq_len": description.seq_len}
    return {"task": description.task, "input_shape": list(description.input_shape),
            "num_classes": description.num_classes}


class ShardedArrays:
    """One split of a shard folder: its length from the index, a batch read from the
    shards its indices fall in (through the folder's shared `ShardReader`)."""

    def __init__(self, name: str, reader: ShardReader, index: ShardIndex, first_shard: int,
                 shard_sizes: Sequence[int]):
        self.name, self.reader, self.index = name, reader, index
        self.first_shard = first_shard  # this split's first shard among the reader's files
        self.shard_sizes = tuple(int(n) for n in shard_sizes)
        self.starts = shard_starts(self.shard_sizes)
        self.description = index.description

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.description.input_shape

    @property
    def num_classes(self) -> int:
        return self.description.num_classes

    def shards_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The reader's shard of each index."""
        return torch.searchsorted(self.starts, indices.to(torch.int64), right=True) - 1 + self.first_shard

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and targets of samples `indices`, in that order.

        Raises:
            DataError: a shard is missing, unreadable or shorter than its index says.
        """
        indices = torch.as_tensor(indices, dtype=torch.int64)
        shards = self.shards_of(indices)
        order = list(dict.fromkeys(shards.tolist()))  # each shard once, in the batch's order
        self.reader.touched(order)
        x_rows, y_rows, positions = [], [], []
        for shard in order:
            arrays = self.reader.arrays(shard)
            here = (shards == shard).nonzero().flatten()
            rows = (indices[here] - self.starts[shard - self.first_shard]).numpy()
            x, y = arrays[self.index.inputs], arrays[self.index.targets]
            expected = self.shard_sizes[shard - self.first_shard]
            if len(x) < expected or len(y) < expected:
                raise DataError(f"training.dataset: shard {self.reader.files[shard]} has {len(x)} inputs and "
                                f"{len(y)} targets, its index says {expected}; write the folder again")
            x_rows.append(x[rows])
            y_rows.append(y[rows])
            positions.append(here)
        where = torch.cat(positions)
        inputs = torch.from_numpy(np.concatenate(x_rows))
        targets = torch.from_numpy(np.concatenate(y_rows))
        back = torch.empty_like(where)
        back[where] = torch.arange(len(where))
        inputs, targets = inputs[back], targets[back]
        if self.description.task == LANGUAGE_MODEL:
            return inputs.to(torch.int64), targets.to(torch.int64)
        return inputs.to(torch.float32), targets.to(torch.int64)

    def subset(self, limit: int | None) -> ShardedArrays:
        """The first `limit` samples in the index's order (whole shards, then part of one)."""
        if limit is None or limit >= len(self):
            return self
        sizes, left = [], limit
        for size in self.shard_sizes:
            if left <= 0:
                break
            sizes.append(min(size, left))
            left -= size
        return ShardedArrays(self.name, self.reader, self.index, self.first_shard, sizes)

    def read_ahead(self, batches: list[torch.Tensor]) -> None:
        """Tell the reader the batches this process will read next, in order."""
        if batches:
            self.reader.plan(self.shards_of(torch.cat(batches)).tolist())


@functools.cache
def _open(location: str, data_dir: str, download: bool, limits: ReaderLimits
          ) -> tuple[ShardIndex, ShardReader]:
    """The folder's index and its reader: one per process, shared by both splits and by
    the training loop's read-ahead."""
    where = object_store.join(location, INDEX)
    if object_store.is_url(location):
        text = store_cache.local_copy(str(where), data_dir, download).read_bytes()
    else:
        try:
            text = Path(where).read_bytes()
        except OSError as e:
            raise DataError(f"training.dataset: {where} cannot be read ({e.strerror or e}); a shard folder "
                            "holds index.json (write it with disttrain.data.shards.write_shards)") from e
    index = parse_index(text, str(where))
    files = [file for split in SPLITS for file, _ in index.splits[split]]
    reader = ShardReader(ShardFiles(location, tuple(files), (index.inputs, index.targets)), data_dir,
                         download, limits)
    return index, reader


def limits_of(training: TrainingConfig) -> ReaderLimits:
    return ReaderLimits(training.shard_cache_bytes, training.num_shards_in_memory, training.num_shards_ahead)


def _location(training: TrainingConfig) -> str:
    location = training.dataset[len(PREFIX):].rstrip("/")
    if object_store.is_url(location):
        problem = object_store.backend_problem(location)
        if problem is not None:
            raise store_cache.DataSourceError(f"training.dataset: {problem}")
        return location
    return str(Path(location).expanduser())


def load_shards(training: TrainingConfig) -> tuple[ShardedArrays, ShardedArrays]:
    """The train and test splits of `shards:URL` (nothing read but the index).

    Raises:
        DataError: the index is missing or malformed; the store's errors as `store_cache`'s.
    """
    index, reader = _open(_location(training), training.data_dir, training.download, limits_of(training))
    name = f"{PREFIX}{object_store.basename(_location(training))}"
    train_sizes = [n for _, n in index.splits["train"]]
    return (ShardedArrays(name, reader, index, 0, train_sizes),
            ShardedArrays(name, reader, index, len(train_sizes), [n for _, n in index.splits["test"]]))


def describe_shards(training: TrainingConfig) -> DatasetDescription:
    index, _ = _open(_location(training), training.data_dir, training.download, limits_of(training))
    return index.description


@dataclass(frozen=True)
class ShardLayout:
    """What the training loop needs of a data set read by shards: its training split's
    shard sizes (for the sampler's order) and where to say the batches to read ahead."""

    shard_sizes: tuple[int, ...]
    read_ahead: Callable[[list[torch.Tensor]], None]


def shard_layout(training: TrainingConfig) -> ShardLayout | None:
    """The layout of `training.dataset`'s training split (after `max_train_samples`) when
    it is read by shards; None for any other data set."""
    if not training.dataset.startswith(PREFIX):
        return None
    train = load_shards(training)[0].subset(training.max_train_samples)
    return ShardLayout(train.shard_sizes, train.read_ahead)
