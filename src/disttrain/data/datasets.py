"""The data sets `training.dataset` names, and what each is (`describe_dataset`).

The built-in image sets are small enough to hold in memory, so a batch is one indexed
gather (`images[indices]`), with no loader processes to start or to shut down. Beside
them: `text:FILE` and `image-folder:DIR` (`data.text`, `data.image_folder`; FILE or DIR
a path or any fsspec URL, cached by `data.store_cache`; an image folder at a URL with a
disk bound read group by group by `data.image_stream`), `shards:DIR` (`data.shards`: array
shards larger than memory, read shard by shard as training reaches them), `torchvision:NAME`
(`data.vision`, the sets of torchvision.datasets), the synthetic sets of any image shape
(`synthetic:3x32x32`) and of tokens (`synthetic:text`), and a user's factory,
`PATH.py:NAME`, `module:NAME` or an entry point of group `disttrain.datasets`, which
returns `(train, test, description)`: two map-style data sets of `(input, target)`
items and a `DatasetDescription` (or a dict of its fields).
"""

from __future__ import annotations

import functools
import gzip
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disttrain.config import TrainingConfig
from disttrain.core import object_store
from disttrain.core.errors import ConfigError, DataError
from disttrain.data import (
    image_folder,
    image_stream,
    plugins,
    shards,
    sources,
    store_cache,
    text,
    user_shards,
    vision,
)
from disttrain.data.batching import Collate, pad_collate
from disttrain.data.description import DatasetDescription
from disttrain.data.mapped import SUBSET_SEED, BatchedDataset, MappedDataset, subset_indices
from disttrain.data.shard_reader import ReaderLimits

# Per-channel (mean, std) of the training images scaled to [0, 1].
NORMALISATION = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
SYNTHETIC_SEED = 1234
DIGITS_TEST_FRACTION = 0.2
DIGITS_FILE = Path(__file__).with_name("digits.csv.gz")
DIGITS_SAMPLES = 1797
NUM_CLASSES = 10  # every supported data set has ten classes
SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_TEXT = "synthetic:text"  # tokens shaped as text:FILE's, for language-model benchmarks
# (channels, height, width) of each data set's images: the one table of shapes, so a
# model can be built from the config alone, without loading any data.
INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32),
    "digits": (1, 8, 8), "synthetic": (1, 28, 28),
}


def dataset_shape(name: str) -> tuple[tuple[int, int, int], int]:
    """(input shape, number of classes) of data set `name`.

    Raises:
        DataError: an unknown data set.
    """
    if name not in INPUT_SHAPES:
        raise DataError(f"training.dataset: unknown data set {name!r}; use one of "
                        f"{', '.join(INPUT_SHAPES)}")
    return INPUT_SHAPES[name], NUM_CLASSES


@dataclass
class ArrayDataset:
    """Images (N, C, H, W) float32, normalised, and labels (N,) int64."""

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int = 10

    def __post_init__(self):
        if len(self.images) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    @property
    def description(self) -> DatasetDescription:
        return DatasetDescription.classification(self.input_shape, self.num_classes)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[indices], self.labels[indices]

    def subset(self, limit: int | None) -> ArrayDataset:
        """The first `limit` samples of a fixed permutation (class-balanced, deterministic)."""
        keep = subset_indices(len(self), limit)
        if keep is None:
            return self
        return ArrayDataset(self.name, self.images[keep], self.labels[keep], self.num_classes)


def _to_tensor(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    x = torch.from_numpy(np.array(images, dtype=np.float32)).div_(255.0)  # a writable copy
    if x.dim() == 3:
        x = x.unsqueeze(1)
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)
    return ((x - mean_t) / std_t).contiguous()


def _from_arrays(name: str, arrays: dict[str, np.ndarray]) -> tuple[ArrayDataset, ArrayDataset]:
    mean, std = NORMALISATION[name]
    return tuple(
        ArrayDataset(name, _to_tensor(arrays[f"{split}_images"], mean, std),
                     torch.from_numpy(arrays[f"{split}_labels"].astype(np.int64)))
        for split in ("train", "test")
    )


def synthetic(num_samples: int, shape: tuple[int, ...] = INPUT_SHAPES["synthetic"],
              name: str = "synthetic") -> tuple[ArrayDataset, ArrayDataset]:
    """A deterministic, learnable, image-shaped data set: ten fixed random prototypes plus
    noise. The test split (a fifth of `num_samples`, at least 10) uses the same prototypes."""
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    prototypes = torch.randn((10, *shape), generator=gen)

    def draw(count: int) -> ArrayDataset:
        labels = torch.randint(0, 10, (count,), generator=gen)
        noise = torch.randn((count, *shape), generator=gen)
        return ArrayDataset(name, (prototypes[labels] + 1.5 * noise).contiguous(), labels)

    return draw(num_samples), draw(max(num_samples // 5, 10))


def synthetic_shape(name: str) -> tuple[int, int, int] | None:
    """The image shape of `synthetic:CxHxW` (e.g. synthetic:3x32x32, a CIFAR-shaped set for
    benchmarks); None for any other name.

    Raises:
        ConfigError: a `synthetic:` spec that is neither `text` nor CxHxW.
    """
    if not name.startswith(SYNTHETIC_PREFIX) or name == SYNTHETIC_TEXT:
        return None
    parts = name[len(SYNTHETIC_PREFIX):].split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"training.dataset: {name!r} must be synthetic:CxHxW (e.g. synthetic:3x32x32) "
                          f"or {SYNTHETIC_TEXT}")
    channels, height, width = (int(p) for p in parts)
    return channels, height, width


def digits() -> tuple[ArrayDataset, ArrayDataset]:
    """The 8x8 handwritten digits shipped with disttrain (1,797 real samples, no download);
    a fixed 80/20 split, normalised by the training split's mean and std.

    The file is the test set of UCI's "Optical Recognition of Handwritten Digits" (E.
    Alpaydin, C. Kaynak, 1998; CC BY 4.0), one row per image: 64 pixel counts in 0..16,
    then the label; the same rows, in the same order, as scikit-learn's `load_digits`.

    Raises:
        DataError: the shipped file is missing or damaged (reinstall disttrain).
    """
    try:
        with gzip.open(DIGITS_FILE, "rt") as handle, warnings.catch_warnings():
            # an empty file is reported below, as damaged, in the error's one line
            warnings.filterwarnings("ignore", "loadtxt: input contained no data", UserWarning)
            rows = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"the digits data set shipped with disttrain cannot be read ({DIGITS_FILE}: "
                        f"{e}); reinstall disttrain") from e
    if rows.shape != (DIGITS_SAMPLES, 65) or not (0 <= rows.min() and rows.max() <= 16):
        raise DataError(f"the digits data set shipped with disttrain is damaged ({DIGITS_FILE}: "
                        f"{rows.shape} values, expected ({DIGITS_SAMPLES}, 65) in 0..16); "
                        "reinstall disttrain")
    images = torch.from_numpy(rows[:, :64].reshape(-1, 1, 8, 8)).div_(16.0)
    labels = torch.from_numpy(rows[:, 64].astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SUBSET_SEED))
    num_test = int(len(labels) * DIGITS_TEST_FRACTION)
    train_idx, test_idx = order[num_test:], order[:num_test]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = ((images - mean) / std).contiguous()
    return (ArrayDataset("digits", images[train_idx], labels[train_idx]),
            ArrayDataset("digits", images[test_idx], labels[test_idx]))


def is_builtin(name: str) -> bool:
    """Whether `name` is one of the built-in image sets of the shape table."""
    return name in INPUT_SHAPES


def describe_dataset(training: TrainingConfig) -> DatasetDescription:
    """The task and shapes of `training.dataset`, for building the model: from the table
    for the built-in sets, from the spec for `text:`, from the folder's layout and first
    image for `image-folder:`; torchvision's set is read and a user's factory is called
    (once per process, cached).

    Raises:
        ConfigError: a plug-in that cannot be found or fails. DataError: bad data.
    """
    name = training.dataset
    if is_builtin(name):
        shape, num_classes = dataset_shape(name)
        return DatasetDescription.classification(shape, num_classes)
    if name.startswith(text.PREFIX) or name == SYNTHETIC_TEXT:
        return text.describe_text(training.seq_len)
    if synthetic_shape(name) is not None:
        return DatasetDescription.classification(synthetic_shape(name), NUM_CLASSES)
    if image_stream.is_streamed(training):
        return image_stream.describe_image_stream(training)
    if name.startswith(image_folder.PREFIX):
        return image_folder.describe_image_folder(_image_folder_spec(training))
    if name.startswith(shards.PREFIX):
        return shards.describe_shards(training)
    if name.startswith(vision.PREFIX):
        return _torchvision(training)[2]
    return _plugin(name, _args_key(training.dataset_args), shards.limits_of(training))[2]


def _torchvision(training: TrainingConfig) -> tuple[MappedDataset, MappedDataset, DatasetDescription]:
    return vision.torchvision_dataset(training.dataset[len(vision.PREFIX):], training.data_dir,
                                      training.download)


def _args_key(args: Any) -> str:
    return json.dumps(dict(args), sort_keys=True, default=str)


@functools.cache
def _plugin(spec: str, args_json: str, limits: ReaderLimits
            ) -> tuple[MappedDataset, MappedDataset, DatasetDescription]:
    """Call a user's data-set factory with `training.dataset_args` and check what it returns.
    Cached: a process asks for the description (to build the model) and then the data. A
    split that lists its shards (`data.user_shards`) is read by them, within `limits`."""
    key = "training.dataset"
    factory = plugins.load_factory(spec, key, plugins.DATASET_GROUP)
    returned = plugins.call_factory(factory, spec, key, **json.loads(args_json))
    if not (isinstance(returned, tuple | list) and len(returned) == 3):
        raise ConfigError(f"{key}: {spec} returned a {type(returned).__name__}; return a tuple "
                          "(train, test, description)")
    train, test, raw = returned
    try:
        description = DatasetDescription.coerce(raw, f"{key}: {spec}")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    splits = []
    for split, data in (("train", train), ("test", test)):
        if user_shards.lists_shards(data):
            data = user_shards.UserShards(f"{spec}'s {split} set", data, limits)
        user_shards.refuse_plain_iterable(data, f"{spec}'s {split} set")
        splits.append(data)
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise ConfigError(f"{key}: {spec}'s {split} set is a {type(data).__name__}, not a map-style "
                              "data set (it needs __len__ and __getitem__)")
        if len(data) == 0:
            raise ConfigError(f"{key}: {spec}'s {split} set is empty")
        item = plugins.call_factory(data.__getitem__, f"{spec} ({split}[0])", key, 0)
        if not (isinstance(item, tuple | list) and len(item) == 2) and not isinstance(item, Mapping):
            raise ConfigError(f"{key}: {spec}'s {split}[0] is a {type(item).__name__}; each item must "
                              "be a pair (input, target) or a mapping of fields (the targets under "
                              "training.target_key)")
    return (MappedDataset(spec, splits[0], description), MappedDataset(spec, splits[1], description),
            description)


def load_datasets(training: TrainingConfig) -> tuple[BatchedDataset, BatchedDataset]:
    """Load the train and test splits named by `training.dataset`, with the sample limits.

    Raises:
        DataError: files are missing (and cannot be downloaded), truncated or malformed.
        ConfigError: a plug-in that cannot be found or fails.
    """
    name = training.dataset
    if name.startswith(text.PREFIX):
        train, test = _load_text(name[len(text.PREFIX):], training)
    elif name == SYNTHETIC_TEXT:
        train, test = text.synthetic_text(training.num_samples, training.seq_len)
    elif synthetic_shape(name) is not None:
        train, test = synthetic(training.num_samples, synthetic_shape(name), name)
    elif image_stream.is_streamed(training):
        train, test = image_stream.load_image_stream(training)
    elif name.startswith(image_folder.PREFIX):
        train, test = image_folder.load_image_folder(_image_folder_spec(training))
    elif name.startswith(shards.PREFIX):
        train, test = shards.load_shards(training)
    elif name.startswith(vision.PREFIX):
        train, test, _ = _torchvision(training)
    elif not is_builtin(name):
        train, test, _ = _plugin(name, _args_key(training.dataset_args), shards.limits_of(training))
    else:
        train, test = _load_builtin(training)
    train, test = train.subset(training.max_train_samples), test.subset(training.max_test_samples)
    if isinstance(train, MappedDataset) and isinstance(test, MappedDataset):  # items batched the user's way
        collate = collate_function(training)
        train, test = (split.batched_by(collate, training.target_key) for split in (train, test))
    return train, test


def _load_text(location: str, training: TrainingConfig) -> tuple[text.TextWindows, text.TextWindows]:
    """`text:FILE` of a local path, or of a URL through its cached copy (the same bytes, so
    the same windows, in every process)."""
    if not object_store.is_url(location):
        return text.load_text(location, training.seq_len)
    copy = store_cache.local_copy(location, training.data_dir, training.download)
    return text.load_text(copy, training.seq_len, name=object_store.basename(location))


def _image_folder_spec(training: TrainingConfig) -> str:
    """`image-folder:DIR` of a local folder, or of a URL's cached copy (which keeps the
    folder's name)."""
    location = training.dataset[len(image_folder.PREFIX):]
    if not object_store.is_url(location):
        return training.dataset
    return image_folder.PREFIX + str(store_cache.local_folder(location, training.data_dir, training.download))


def shard_layout(training: TrainingConfig) -> shards.ShardLayout | None:
    """What the training loop needs of `training.dataset` when it is read by shards
    (`shards:DIR`, or a user's data set that lists its shards, whole: a
    `max_train_samples` subset of it is a plain one); None for any other data set."""
    name = training.dataset
    if name.startswith(shards.PREFIX):
        return shards.shard_layout(training)
    if image_stream.is_streamed(training):
        return image_stream.image_stream_layout(training)
    if is_builtin(name) or name == SYNTHETIC_TEXT or name.startswith(
            (text.PREFIX, image_folder.PREFIX, vision.PREFIX, SYNTHETIC_PREFIX)):
        return None
    train = load_datasets(training)[0]
    data = getattr(train, "dataset", None)
    if not isinstance(data, user_shards.UserShards) or train.indices is not None:
        return None
    return shards.ShardLayout(data.shard_sizes, data.read_ahead)


def collate_function(training: TrainingConfig) -> Collate | None:
    """What makes a batch of a user's items (`training.collate_fn`): None for torch's
    default collation, `pad_collate`, or the user's own function.

    Raises:
        ConfigError: the function cannot be found.
    """
    spec = training.collate_fn
    if not spec:
        return None
    if spec == "pad":
        return functools.partial(pad_collate, target_key=training.target_key)
    return plugins.load_factory(spec, "training.collate_fn", plugins.COLLATE_GROUP)


def _load_builtin(training: TrainingConfig) -> tuple[ArrayDataset, ArrayDataset]:
    name = training.dataset
    expected_shape, _ = dataset_shape(name)  # an unknown name fails here, naming the known ones
    if name == "synthetic":
        train, test = synthetic(training.num_samples)
    elif name == "digits":
        train, test = digits()
    elif name in ("mnist", "fashion_mnist"):
        arrays = sources.load_idx_dataset(name, Path(training.data_dir), training.download)
        train, test = _from_arrays(name, arrays)
    else:  # cifar10
        arrays = sources.load_cifar10(Path(training.data_dir), training.download)
        train, test = _from_arrays(name, arrays)
    for split in (train, test):
        if split.input_shape != expected_shape:
            raise DataError(f"{name} images are {split.input_shape}, expected {expected_shape}")
    return train, test
