"""`torchvision:NAME`: an image-classification set of `torchvision.datasets` (CIFAR10,
CIFAR100, MNIST, FashionMNIST, KMNIST, SVHN), read by torchvision from the data folder
(`training.data_dir`), from the optional extra `vision` (`pip install 'disttrain[vision]'`).

The folder holds torchvision's own layout, as `torchvision.datasets.NAME(root=DIR)` reads
it: `DIR/cifar-10-batches-py/`, `DIR/cifar-100-python/`, `DIR/MNIST/raw/` (the same for
FashionMNIST and KMNIST), `DIR/train_32x32.mat`. Missing files are downloaded by
torchvision, which checks its own checksums, only when `training.download` allows it.
With downloads off, the archives torchvision would download, put there by hand
(`DIR/cifar-10-python.tar.gz`, `DIR/MNIST/raw/*.gz`), are checked against torchvision's
checksums and unpacked, with no network.

An item is `(image, class index)`, the image a float tensor (C, H, W) scaled to [0, 1] and
normalised by the set's published per-channel mean and std of its training images. The
sets are map-style, batched through `MappedDataset`: the sampler, exact resume, the data
ledger and loader workers work as for any data set (it pickles: torchvision's object with
its arrays, and the normalisation of this module).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from disttrain.core.errors import ConfigError
from disttrain.data.description import DatasetDescription
from disttrain.data.mapped import MappedDataset
from disttrain.data.plugins import one_line

logger = logging.getLogger(__name__)

PREFIX = "torchvision:"
KEY = "training.dataset"
EXTRA = "pip install 'disttrain[vision]'"
_IDX_FILES = ("train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
              "t10k-labels-idx1-ubyte (or their .gz)")


@dataclass(frozen=True)
class VisionSet:
    """How disttrain calls one of torchvision's data sets and what it knows of it.

    `split_by`: "train" when the constructor takes `train=True/False`, "split" when it
    takes `split="train"/"test"`. `mean`, `std`: per channel, of the training images
    scaled to [0, 1], as published with the set. `files`: what to put in `folder` (under
    the data folder). `num_classes`: for a set whose object does not list its `classes`.
    """

    name: str
    split_by: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    files: str
    folder: str = ""
    num_classes: int = 10


# The values of the sets disttrain also reads itself are those of datasets.NORMALISATION.
SETS = {s.name: s for s in (
    VisionSet("CIFAR10", "train", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
              "cifar-10-python.tar.gz (or its unpacked cifar-10-batches-py/)"),
    VisionSet("CIFAR100", "train", (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
              "cifar-100-python.tar.gz (or its unpacked cifar-100-python/)", num_classes=100),
    VisionSet("MNIST", "train", (0.1307,), (0.3081,), _IDX_FILES, "MNIST/raw"),
    VisionSet("FashionMNIST", "train", (0.2860,), (0.3530,), _IDX_FILES, "FashionMNIST/raw"),
    VisionSet("KMNIST", "train", (0.1918,), (0.3483,), _IDX_FILES, "KMNIST/raw"),
    VisionSet("SVHN", "split", (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970),
              "train_32x32.mat and test_32x32.mat (reading them needs scipy)"),
)}
# Sets of torchvision.datasets whose targets are not one class index per image: boxes,
# masks, captions, optical flow, disparities, video clips, pairs, attributes.
_NOT_CLASSIFICATION = re.compile(r"Detection|Segmentation|Caption|Stereo|Flying|Sintel|HD1K|Kitti"
                                 r"|Cityscapes|WIDERFace|SBDataset|Flickr|SBU|Kinetics|HMDB|UCF|Moving"
                                 r"|PhotoTour|LFWPairs|CelebA")


def import_torchvision(key: str, spec: str) -> ModuleType:
    """torchvision, imported; the one place that says what to do when it cannot be.

    Args:
        key: the config key naming it (`training.dataset`), for the message.
        spec: what needs it (`torchvision:CIFAR10`).

    Raises:
        ConfigError: torchvision is not installed (naming the extra), or is installed but
            fails to import (a build for another torch).
    """
    try:
        import torchvision
    except ModuleNotFoundError as e:
        raise ConfigError(f"{key}: {spec} needs torchvision; install the extra: {EXTRA}") from e
    except Exception as e:  # e.g. a CUDA build's operators against a CPU torch
        raise ConfigError(f"{key}: torchvision is installed but cannot be imported ({one_line(e)}); "
                          f"install the torchvision built for torch {torch.__version__}, from the index "
                          "torch came from") from e
    return torchvision


def resolve_name(name: str, available: list[str]) -> VisionSet:
    """The set `torchvision:name` names (any case: `cifar10` is CIFAR10).

    Args:
        available: the names torchvision.datasets holds, for the message.

    Raises:
        ConfigError: torchvision has no such set, or it is not an image-classification set
            disttrain reads by name.
    """
    found = {s.lower(): s for s in SETS}.get(name.lower())
    if found is not None:
        return SETS[found]
    supported = ", ".join(SETS)
    listed = {s.lower(): s for s in available}.get(name.lower())
    if listed is None:
        raise ConfigError(f"{KEY}: torchvision.datasets has no {name!r}; use one of {supported} "
                          f"(e.g. {PREFIX}CIFAR10)")
    if _NOT_CLASSIFICATION.search(listed):
        raise ConfigError(f"{KEY}: {PREFIX}{listed} is not an image-classification set (its targets are "
                          f"not one class per image); {PREFIX}NAME reads {supported}")
    raise ConfigError(f"{KEY}: {PREFIX}{listed} is not one of the sets disttrain reads by name "
                      f"({supported}); write a data-set factory that builds it (PATH.py:FACTORY "
                      "returning train, test, description)")


class NormalisedImages(torch.utils.data.Dataset):
    """torchvision's set, each item `(image, class index)` as `(float tensor (C, H, W),
    int)`, the image scaled to [0, 1] and normalised per channel."""

    def __init__(self, images: Any, mean: tuple[float, ...], std: tuple[float, ...]):
        self.images = images
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, target = self.images[index]
        pixels = torch.from_numpy(np.array(image, dtype=np.float32))  # PIL: (H, W) or (H, W, C)
        pixels = pixels.unsqueeze(0) if pixels.dim() == 2 else pixels.permute(2, 0, 1)
        return ((pixels / 255.0 - self.mean) / self.std).contiguous(), int(target)


def _archives(cls: type, root: Path) -> list[tuple[Path, str]]:
    """(path, md5) of the files torchvision downloads for `cls` before unpacking them; none
    for a set it reads as downloaded (SVHN's .mat)."""
    if isinstance(getattr(cls, "tgz_md5", None), str):  # CIFAR10, CIFAR100
        return [(root / cls.filename, cls.tgz_md5)]
    resources = getattr(cls, "resources", None)
    if isinstance(resources, list):  # MNIST and its kin: DIR/<Class>/raw/<file>.gz
        return [(root / cls.__name__ / "raw" / name, md5) for name, md5 in resources]
    return []


def _construct(torchvision: ModuleType, chosen: VisionSet, root: Path, train: bool, download: bool) -> Any:
    """torchvision's object for one split, downloading only when allowed."""
    cls = getattr(torchvision.datasets, chosen.name)
    split = {"train": train} if chosen.split_by == "train" else {"split": "train" if train else "test"}
    try:
        return cls(str(root), download=download, **split)
    except RuntimeError:
        if download:
            raise
        # Downloads off: archives already in place pass torchvision's own check of them
        # (check_integrity), so with download=True it unpacks them and fetches nothing.
        archives = _archives(cls, root)
        if not archives or not all(path.is_file() for path, _ in archives):
            raise
        for path, md5 in archives:
            if not torchvision.datasets.utils.check_integrity(str(path), md5):
                raise ConfigError(f"{KEY}: {path} is not the file torchvision checks for {PREFIX}"
                                  f"{chosen.name} (its MD5 is not {md5}); put the original there, or "
                                  "unpack it in its place") from None
        logger.info("unpacking %s under %s", ", ".join(path.name for path, _ in archives), root)
        return cls(str(root), download=True, **split)


def _describe_failure(spec: str, chosen: VisionSet, root: Path, download: bool, error: Exception) -> str:
    if isinstance(error, ModuleNotFoundError) and error.name:
        return f"{KEY}: {spec} needs the package {error.name}; pip install {error.name}"
    where = f"put {chosen.files} in {root / chosen.folder} (torchvision's layout), or pass --data-dir"
    if download:
        return f"{KEY}: {spec} is not in {root} and torchvision could not get it ({one_line(error)}); {where}"
    if isinstance(error, RuntimeError):
        return (f"{KEY}: {spec} is not in {root} (or is damaged) and downloads are off "
                f"(training.download: false); {where}, or allow downloads")
    return f"{KEY}: reading {spec} from {root} failed ({one_line(error)}); {where}"


@functools.cache
def torchvision_dataset(name: str, data_dir: str, download: bool
                        ) -> tuple[MappedDataset, MappedDataset, DatasetDescription]:
    """The train and test sets of `torchvision:name` under `data_dir`, and their
    description (input shape from the first image, classes from the set). Cached: a
    process asks for the description (to build the model) and then the data.

    Raises:
        ConfigError: torchvision is missing or cannot be imported, the name is unknown or
            not image classification, the files are not in the folder and cannot be
            downloaded (the message names the folder and what to put there), an archive put
            there by hand is not the one torchvision checks for, or a package the set needs
            (scipy for SVHN) is missing.
    """
    spec = PREFIX + name
    torchvision = import_torchvision(KEY, spec)
    chosen = resolve_name(name, list(torchvision.datasets.__all__))
    spec = PREFIX + chosen.name
    root = Path(data_dir).expanduser()
    try:
        train, test = (_construct(torchvision, chosen, root, split, download) for split in (True, False))
    except ConfigError:
        raise
    except Exception as e:  # torchvision's: missing files, a failed download, a missing package
        raise ConfigError(_describe_failure(spec, chosen, root, download, e)) from e
    classes = getattr(train, "classes", None)
    num_classes = len(classes) if classes else chosen.num_classes
    train_images = NormalisedImages(train, chosen.mean, chosen.std)
    description = DatasetDescription.classification(tuple(train_images[0][0].shape), num_classes)
    logger.info("%s from %s: %d train and %d test images of %s, %d classes", spec, root, len(train),
                len(test), description.input_shape, num_classes)
    return (MappedDataset(spec, train_images, description),
            MappedDataset(spec, NormalisedImages(test, chosen.mean, chosen.std), description), description)

