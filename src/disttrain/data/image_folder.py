"""`image-folder:DIR`: images sorted into one sub-folder per class, held in memory.

`DIR/<class>/*.png|jpg|...` (classes in sorted folder order); when `DIR` holds `train/`
and `test/`, each laid out so, they are the two splits, else a fixed fifth of the images
is the test set. Every image is read as RGB, scaled to [0, 1] and normalised by the
training split's per-channel mean and std; all must be of one size (resize them first).
Reading images needs Pillow (installed with disttrain, through matplotlib). A folder at a
URL is fetched whole into the cache first (`data.store_cache`), or, with
`training.shard_cache_bytes` set, read group by group (`data.image_stream`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from disttrain.core.errors import ConfigError, DataError
from disttrain.data.description import DatasetDescription
from disttrain.data.mapped import SUBSET_SEED

PREFIX = "image-folder:"
SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}
TEST_FRACTION = 0.2
SPLITS = ("train", "test")


def _image_module():
    try:
        from PIL import Image
    except ImportError as e:
        raise ConfigError("training.dataset: image-folder needs Pillow; pip install pillow") from e
    return Image


def _classes(folder: Path) -> list[str]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"training.dataset: {folder} has no class sub-folders; put each class's "
                        "images in a folder of its own, DIR/<class>/image.png")
    return classes


def _files(folder: Path, classes: list[str]) -> list[tuple[Path, int]]:
    found = [(path, label) for label, name in enumerate(classes)
             for path in sorted((folder / name).iterdir()) if path.suffix.lower() in SUFFIXES]
    if not found:
        raise DataError(f"training.dataset: no images ({', '.join(sorted(SUFFIXES))}) under {folder}")
    return found


def _root(spec: str) -> Path:
    folder = Path(spec[len(PREFIX):]).expanduser()
    if not folder.is_dir():
        raise DataError(f"training.dataset: {folder} is not a folder; give image-folder:DIR with one "
                        "sub-folder of images per class")
    return folder


def _layout(spec: str) -> tuple[Path, list[str], bool]:
    """(root, classes, whether it holds train/ and test/ splits)."""
    root = _root(spec)
    split = all((root / s).is_dir() for s in SPLITS)
    return root, _classes(root / "train" if split else root), split


def _read(path: Path) -> np.ndarray:
    try:
        with _image_module().open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except OSError as e:
        raise DataError(f"training.dataset: {path} is not a readable image ({e})") from e


def describe_image_folder(spec: str) -> DatasetDescription:
    """Classes and the shape of the first image, without reading the others."""
    root, classes, split = _layout(spec)
    first, _ = _files(root / "train" if split else root, classes)[0]
    height, width, channels = _read(first).shape
    return DatasetDescription.classification((channels, height, width), len(classes))


def _stack(files: list[tuple[Path, int]], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    images = []
    for path, _ in files:
        pixels = _read(path)
        if pixels.shape != shape:
            raise DataError(f"training.dataset: {path} is {pixels.shape[1]}x{pixels.shape[0]}, the first "
                            f"image {shape[1]}x{shape[0]}; every image must be of one size (resize them)")
        images.append(pixels)
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255.0)
    return x, torch.tensor([label for _, label in files], dtype=torch.int64)


def load_image_folder(spec: str):
    """Train and test `ArrayDataset`s of the images under `spec`'s folder.

    Raises:
        DataError: no folder, no classes or images, an unreadable image, images of
            different sizes.
    """
    from disttrain.data.datasets import ArrayDataset  # datasets dispatches here

    root, classes, split = _layout(spec)
    description = describe_image_folder(spec)
    shape = (description.input_shape[1], description.input_shape[2], description.input_shape[0])
    if split:
        train_x, train_y = _stack(_files(root / "train", classes), shape)
        test_x, test_y = _stack(_files(root / "test", classes), shape)
    else:
        x, y = _stack(_files(root, classes), shape)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SUBSET_SEED))
        num_test = max(1, int(len(y) * TEST_FRACTION))
        train_x, train_y, test_x, test_y = x[order[num_test:]], y[order[num_test:]], x[order[:num_test]], \
            y[order[:num_test]]
    mean = train_x.mean(dim=(0, 2, 3)).view(1, -1, 1, 1)
    std = train_x.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1)
    name = f"{PREFIX}{root.name}"
    return (ArrayDataset(name, ((train_x - mean) / std).contiguous(), train_y, len(classes)),
            ArrayDataset(name, ((test_x - mean) / std).contiguous(), test_y, len(classes)))
