"""The built-in data sets beside the image sets: `text:FILE` (byte tokens, windows shifted
by one, a held-out tail) and `image-folder:DIR` (a class per folder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError, DataError
from disttrain.data import LANGUAGE_MODEL, DatasetDescription, describe_dataset, load_datasets
from tests.plugin_files import write_text


def test_text_windows_are_the_files_bytes_shifted_by_one(tmp_path):
    path = write_text(tmp_path)
    data = path.read_bytes()
    config = TrainingConfig(dataset=f"text:{path}", seq_len=16)
    train, test = load_datasets(config)
    assert describe_dataset(config) == DatasetDescription.language_model(256, 16)
    assert describe_dataset(config).task == LANGUAGE_MODEL
    num_windows = (len(data) - 1) // 16
    assert len(train) + len(test) == num_windows and len(test) == int(num_windows * 0.1)
    inputs, targets = train.batch(torch.tensor([0, 5]))
    assert inputs.shape == targets.shape == (2, 16) and inputs.dtype == torch.int64
    assert bytes(inputs[1].tolist()) == data[80:96] and bytes(targets[1].tolist()) == data[81:97]
    # The test set is the tail of the text: its windows start after every training window's.
    test_inputs, _ = test.batch(torch.arange(len(test)))
    assert bytes(test_inputs[-1].tolist()) == data[(num_windows - 1) * 16:num_windows * 16]
    assert len(load_datasets(TrainingConfig(dataset=f"text:{path}", seq_len=16, max_train_samples=7))[0]) == 7


def test_a_text_too_short_or_not_utf8_is_a_clear_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match=r"4 bytes, too few .* training.seq_len=16 \(needs 33\)"):
        load_datasets(TrainingConfig(dataset=f"text:{short}", seq_len=16))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ok \xff\xfe" * 50)
    with pytest.raises(DataError, match="is not UTF-8 text"):
        load_datasets(TrainingConfig(dataset=f"text:{binary}", seq_len=16))
    with pytest.raises(DataError, match="cannot be read"):
        load_datasets(TrainingConfig(dataset=f"text:{tmp_path / 'absent.txt'}", seq_len=16))


def write_images(folder, classes=("cat", "dog"), per_class=5, size=(6, 4)):
    Image = pytest.importorskip("PIL.Image", reason="image-folder needs Pillow")
    rng = np.random.default_rng(0)
    for label, name in enumerate(classes):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 100, (size[1], size[0], 3), dtype=np.uint8) + 120 * label
            Image.fromarray(pixels).save(folder / name / f"{i}.png")


def test_an_image_folder_has_a_class_per_sub_folder(tmp_path):
    write_images(tmp_path / "pets")
    config = TrainingConfig(dataset=f"image-folder:{tmp_path / 'pets'}")
    assert describe_dataset(config) == DatasetDescription.classification((3, 4, 6), 2)
    train, test = load_datasets(config)
    assert len(train) == 8 and len(test) == 2 and train.input_shape == (3, 4, 6)
    images, labels = train.batch(torch.arange(8))
    assert sorted(labels.tolist() + test.batch(torch.arange(2))[1].tolist()) == [0] * 5 + [1] * 5
    # Normalised by the training split: the dogs (brighter) are above zero, the cats below.
    assert images[labels == 1].mean() > 0 > images[labels == 0].mean()


def test_an_image_folder_with_train_and_test_uses_them(tmp_path):
    write_images(tmp_path / "set" / "train", per_class=3)
    write_images(tmp_path / "set" / "test", per_class=2)
    train, test = load_datasets(TrainingConfig(dataset=f"image-folder:{tmp_path / 'set'}"))
    assert len(train) == 6 and len(test) == 4


def test_images_of_different_sizes_are_a_clear_error(tmp_path):
    write_images(tmp_path / "a", classes=("x",), size=(6, 4))
    write_images(tmp_path / "b", classes=("y",), size=(5, 5))
    (tmp_path / "b" / "y").rename(tmp_path / "a" / "y")
    with pytest.raises(DataError, match="is 5x5, the first image 6x4; every image must be of one size"):
        load_datasets(TrainingConfig(dataset=f"image-folder:{tmp_path / 'a'}"))
    with pytest.raises(DataError, match="has no class sub-folders"):
        load_datasets(TrainingConfig(dataset=f"image-folder:{tmp_path / 'b'}"))


def test_synthetic_sets_of_the_shipped_workloads_shapes():
    cifar = TrainingConfig(dataset="synthetic:3x32x32", num_samples=40)
    assert describe_dataset(cifar) == DatasetDescription.classification((3, 32, 32), 10)
    train, test = load_datasets(cifar)
    assert len(train) == 40 and len(test) == 10 and train.batch(torch.arange(4))[0].shape == (4, 3, 32, 32)
    tokens = TrainingConfig(dataset="synthetic:text", num_samples=30, seq_len=8)
    assert describe_dataset(tokens) == DatasetDescription.language_model(256, 8)
    train, test = load_datasets(tokens)
    inputs, targets = train.batch(torch.arange(30))
    assert len(test) == 3 and inputs.shape == (30, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
    again, _ = load_datasets(tokens)
    assert torch.equal(again.batch(torch.arange(30))[0], inputs)  # the same stream in every process
    # Each byte has a few successors only: a model can learn it (perplexity 256 -> about 4).
    pairs = {(int(a), int(b)) for a, b in zip(inputs.flatten(), targets.flatten(), strict=True)}
    assert len(pairs) <= 4 * len({a for a, _ in pairs})
    with pytest.raises(ConfigError, match="must be synthetic:CxHxW"):
        describe_dataset(TrainingConfig(dataset="synthetic:32x32"))
