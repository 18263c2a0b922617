"""`image-folder:URL` on object storage read group by group: the folder listed once, its
images cut into groups that are the shards of `data.shard_order` and `data.shard_reader`.

Used for an image folder at a URL when `training.shard_cache_bytes` is set (a bound on the
disk says the folder may not fit on it); without one the folder is fetched whole, as
`data.image_folder` reads it. The layout is `image_folder`'s: `URL/<class>/<image>`, or
`URL/train/<class>/...` and `URL/test/<class>/...` as the two splits.

One listing (names and sizes) gives the classes and every image, so the data set's length
and each group's are known before any image is fetched. Each split's images (classes in
sorted order, files sorted within) are put in one fixed order (`SUBSET_SEED`), so a group
mixes classes; without train/ and test/ the first fifth of that order is the test split,
the same images `image_folder` holds out. Each split's images are then cut into groups of
`IMAGES_PER_SHARD` in that order. A group's images are fetched when training reaches it (or
ahead of that), each into the cache through `store_cache.local_copy` and read at once (so
another process's disk bound removing a copy costs that image's fetch again), within the
reader's disk, memory and read-ahead bounds. Images are scaled to [0, 1] and normalised by a fixed
mean and std of 0.5 per channel (the whole split's statistics would need every image read
first); all must be of the first image's size.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import torch

from disttrain.config import TrainingConfig
from disttrain.core import object_store
from disttrain.core.errors import DataError
from disttrain.data import store_cache
from disttrain.data.description import DatasetDescription
from disttrain.data.image_folder import PREFIX, SPLITS, SUFFIXES, TEST_FRACTION, _image_module
from disttrain.data.mapped import SUBSET_SEED
from disttrain.data.shard_reader import Arrays, ShardContents, ShardFiles, ShardReader
from disttrain.data.shards import ShardedArrays, ShardIndex, ShardLayout, limits_of

IMAGES_PER_SHARD = 64
MEAN, STD = 0.5, 0.5

Images = list[tuple[str, int]]  # (name under the folder, label)


def is_streamed(training: TrainingConfig) -> bool:
    """Whether `training.dataset` is an image folder on a store read group by group."""
    location = training.dataset[len(PREFIX):]
    return (training.dataset.startswith(PREFIX) and object_store.is_url(location)
            and training.shard_cache_bytes > 0)


def _images(listing: dict[str, dict], prefix: str, url: str) -> tuple[list[str], Images]:
    """The classes under `prefix` (`""` or `"train/"`) and their images, in sorted order."""
    found: dict[str, list[str]] = {}
    for name in listing:
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix):].split("/")
        if len(parts) == 2 and not parts[0].startswith(".") and Path(parts[1]).suffix.lower() in SUFFIXES:
            found.setdefault(parts[0], []).append(name)
    classes = sorted(found)
    if not classes:
        raise DataError(f"training.dataset: {url}/{prefix} has no class folders of images "
                        f"({', '.join(sorted(SUFFIXES))}); put each class's images in a folder of its own, "
                        "URL/<class>/image.png")
    return classes, [(name, label) for label, c in enumerate(classes) for name in sorted(found[c])]


def _shuffled(images: Images) -> Images:
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SUBSET_SEED))
    return [images[i] for i in order.tolist()]


def _groups(split: str, images: Images) -> list[tuple[str, Images]]:
    return [(f"{split}-{number:05d}", images[start:start + IMAGES_PER_SHARD])
            for number, start in enumerate(range(0, len(images), IMAGES_PER_SHARD))]


def _read(data: bytes, name: str) -> np.ndarray:
    try:
        with _image_module().open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except OSError as e:
        raise DataError(f"training.dataset: {name} is not a readable image ({e})") from e


class _DecodeGroup:
    """A group's copies as normalised float32 images (C, H, W) and their labels (picklable)."""

    def __init__(self, members: list[list[str]], labels: list[list[int]], shape: tuple[int, ...]):
        self.members, self.labels, self.shape = members, labels, shape

    def __call__(self, contents: list[bytes], shard: int) -> Arrays:
        images = []
        for data, name in zip(contents, self.members[shard], strict=True):
            pixels = _read(data, name)
            if pixels.shape != self.shape:
                raise DataError(f"training.dataset: {name} is {pixels.shape[1]}x{pixels.shape[0]}, the first "
                                f"image {self.shape[1]}x{self.shape[0]}; every image must be of one size "
                                "(resize them)")
            images.append(pixels)
        x = np.stack(images).transpose(0, 3, 1, 2).astype(np.float32) / 255.0
        return {"x": (x - MEAN) / STD, "y": np.asarray(self.labels[shard], dtype=np.int64)}


@functools.cache
def _open(location: str, data_dir: str, download: bool, limits) -> tuple[ShardIndex, ShardReader]:
    """The folder's groups and their reader: one per process, listed once."""
    listing = store_cache.list_folder(location)
    split = all(any(name.startswith(f"{s}/") for name in listing) for s in SPLITS)
    if split:
        classes, train = _images(listing, "train/", location)
        _, test = _images(listing, "test/", location)
        train, test = _shuffled(train), _shuffled(test)
    else:
        classes, everything = _images(listing, "", location)
        ordered = _shuffled(everything)
        num_test = max(1, int(len(ordered) * TEST_FRACTION))
        train, test = ordered[num_test:], ordered[:num_test]
        if not train:
            raise DataError(f"training.dataset: {location} holds {len(ordered)} image(s), too few for a "
                            "training and a test split; add images")
    groups = {"train": _groups("train", train), "test": _groups("test", test)}
    every = groups["train"] + groups["test"]
    members = [[name for name, _ in images] for _, images in every]
    labels = [[label for _, label in images] for _, images in every]
    first = store_cache.local_copy(str(object_store.join(location, members[0][0])), data_dir, download)
    height, width, channels = _read(first.read_bytes(), members[0][0]).shape
    description = DatasetDescription.classification((channels, height, width), len(classes))
    index = ShardIndex("x", "y", description,
                       {s: [(file, len(images)) for file, images in groups[s]] for s in SPLITS})
    contents = ShardContents(members=members, decode=_DecodeGroup(members, labels, (height, width, channels)))
    reader = ShardReader(ShardFiles(location, tuple(file for file, _ in every), ("x", "y")), data_dir,
                         download, limits, contents)
    return index, reader


def _location(training: TrainingConfig) -> str:
    location = training.dataset[len(PREFIX):].rstrip("/")
    problem = object_store.backend_problem(location)
    if problem is not None:
        raise store_cache.DataSourceError(f"training.dataset: {problem}")
    return location


def _opened(training: TrainingConfig) -> tuple[ShardIndex, ShardReader]:
    return _open(_location(training), training.data_dir, training.download, limits_of(training))


def load_image_stream(training: TrainingConfig) -> tuple[ShardedArrays, ShardedArrays]:
    """The train and test splits of a streamed image folder (nothing fetched but one image).

    Raises:
        DataError: no classes or images; the store's errors as `store_cache`'s.
    """
    index, reader = _opened(training)
    name = f"{PREFIX}{object_store.basename(_location(training))}"
    train_sizes = [n for _, n in index.splits["train"]]
    return (ShardedArrays(name, reader, index, 0, train_sizes),
            ShardedArrays(name, reader, index, len(train_sizes), [n for _, n in index.splits["test"]]))


def describe_image_stream(training: TrainingConfig) -> DatasetDescription:
    return _opened(training)[0].description


def image_stream_layout(training: TrainingConfig) -> ShardLayout:
    """The training split's groups (after `max_train_samples`) for the sampler's order."""
    train = load_image_stream(training)[0].subset(training.max_train_samples)
    return ShardLayout(train.shard_sizes, train.read_ahead)
