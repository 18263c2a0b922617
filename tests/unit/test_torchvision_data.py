"""`torchvision:NAME` data sets: names resolved, images normalised, torchvision's layout
read from the data folder, and each way it can fail one line with exit code 2, nothing
started. The tests that need torchvision skip without it (the `vision` extra); the error
without it is shown everywhere, torchvision hidden from the import."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError
from disttrain.data import DatasetDescription, describe_dataset, load_datasets, vision
from disttrain.data.datasets import NORMALISATION
from tests.unit.test_plugins import run_failing, torchvision_or_skip

TORCHVISION_NAMES = ["CIFAR10", "CIFAR100", "MNIST", "FashionMNIST", "KMNIST", "SVHN", "STL10",
                     "VOCSegmentation", "CocoDetection", "Kinetics", "ImageFolder"]


def test_without_torchvision_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` fails as if absent
    line = run_failing(["baseline", "--dataset", "torchvision:CIFAR10", "--data-dir", str(tmp_path / "data")],
                       tmp_path, capsys)
    assert "training.dataset: torchvision:CIFAR10 needs torchvision" in line
    assert "pip install 'disttrain[vision]'" in line


def test_a_torchvision_built_for_another_torch_is_named(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError) as caught:
        vision.import_torchvision("training.dataset", "torchvision:MNIST")
    assert str(caught.value) == (
        "training.dataset: torchvision is installed but cannot be imported (RuntimeError: operator "
        f"torchvision::nms does not exist); install the torchvision built for torch {torch.__version__}, "
        "from the index torch came from")


def test_names_resolve_in_any_case_and_other_sets_are_refused():
    assert vision.resolve_name("cifar10", TORCHVISION_NAMES).name == "CIFAR10"
    assert vision.resolve_name("fashionmnist", TORCHVISION_NAMES).name == "FashionMNIST"
    assert vision.resolve_name("SVHN", TORCHVISION_NAMES).split_by == "split"
    with pytest.raises(ConfigError, match=r"torchvision.datasets has no 'imagenet1'; use one of CIFAR10, "
                                          r"CIFAR100, MNIST, FashionMNIST, KMNIST, SVHN"):
        vision.resolve_name("imagenet1", TORCHVISION_NAMES)
    for other_task in ("VOCSegmentation", "cocodetection", "Kinetics"):
        with pytest.raises(ConfigError, match=r"is not an image-classification set \(its targets are not "
                                              r"one class per image\)"):
            vision.resolve_name(other_task, TORCHVISION_NAMES)
    with pytest.raises(ConfigError, match=r"torchvision:STL10 is not one of the sets disttrain reads by "
                                          r"name .*write a data-set factory"):
        vision.resolve_name("STL10", TORCHVISION_NAMES)


def test_images_become_normalised_float_tensors_and_pickle():
    gray = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4) * 20, mode="L")
    rgb = Image.fromarray(np.full((2, 5, 3), (0, 128, 255), dtype=np.uint8), mode="RGB")
    one = vision.NormalisedImages([(gray, np.int64(3))], (0.5,), (0.25,))
    image, label = one[0]
    assert image.shape == (1, 3, 4) and image.dtype == torch.float32 and label == 3 and type(label) is int
    assert image[0, 1, 2].item() == pytest.approx((6 * 20 / 255 - 0.5) / 0.25)
    three = vision.NormalisedImages([(rgb, 1)], (0.1, 0.2, 0.3), (0.5, 0.5, 0.5))
    image, _ = three[0]
    assert image.shape == (3, 2, 5)
    expected = [(0 - 0.1) / 0.5, (128 / 255 - 0.2) / 0.5, (1 - 0.3) / 0.5]
    assert image[:, 0, 0].tolist() == pytest.approx(expected)
    again = pickle.loads(pickle.dumps(three))  # what a spawned loader worker receives
    assert torch.equal(again[0][0], image)


def test_the_sets_disttrain_also_reads_itself_share_its_normalisation():
    for name, own in (("MNIST", "mnist"), ("FashionMNIST", "fashion_mnist"), ("CIFAR10", "cifar10")):
        assert (vision.SETS[name].mean, vision.SETS[name].std) == NORMALISATION[own]


def test_cifar_not_in_the_folder_with_downloads_off_names_folder_and_files(tmp_path, capsys):
    torchvision_or_skip()
    data = tmp_path / "data"
    argv = ["baseline", "--dataset", "torchvision:cifar100", "--data-dir", str(data),
            "--set", "training.download=false"]
    line = run_failing(argv, tmp_path, capsys)
    assert line == (f"error: training.dataset: torchvision:CIFAR100 is not in {data} (or is damaged) and "
                    "downloads are off (training.download: false); put cifar-100-python.tar.gz (or its "
                    f"unpacked cifar-100-python/) in {data} (torchvision's layout), or pass --data-dir, "
                    "or allow downloads")
    assert not data.exists()
    line = run_failing(["baseline", "--dataset", "torchvision:KMNIST", "--data-dir", str(data),
                        "--set", "training.download=false"], tmp_path, capsys)
    assert "put train-images-idx3-ubyte, " in line and f"in {data / 'KMNIST' / 'raw'} " in line
    line = run_failing(["baseline", "--dataset", "torchvision:Flowers", "--data-dir", str(data)],
                       tmp_path, capsys)
    assert "torchvision.datasets has no 'Flowers'; use one of CIFAR10" in line
    line = run_failing(["baseline", "--dataset", "torchvision:VOCDetection", "--data-dir", str(data)],
                       tmp_path, capsys)
    assert "torchvision:VOCDetection is not an image-classification set" in line


@pytest.fixture
def torchvision_mnist(tmp_path, real_data_dir):
    """A data folder in torchvision's layout: MNIST's four .gz files in DIR/MNIST/raw/ (links
    to the real copy), as a user puts them there by hand."""
    torchvision_or_skip()
    raw = tmp_path / "tv" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for source in (real_data_dir / "mnist").glob("*-ubyte.gz"):
        (raw / source.name).symlink_to(source)
    return tmp_path / "tv"


def test_mnist_through_torchvision_is_disttrains_own_mnist(torchvision_mnist, real_data_dir):
    """The .gz files in torchvision's layout are checked and unpacked with downloads off; the
    items are the same normalised images and labels as disttrain's own reader gives."""
    config = TrainingConfig(dataset="torchvision:MNIST", data_dir=str(torchvision_mnist), download=False,
                            max_train_samples=200, max_test_samples=100)
    assert describe_dataset(config) == DatasetDescription.classification((1, 28, 28), 10)
    assert (torchvision_mnist / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    train, test = load_datasets(config)
    assert (len(train), len(test)) == (200, 100) and train.name == "torchvision:MNIST"
    own_train, own_test = load_datasets(TrainingConfig(dataset="mnist", data_dir=str(real_data_dir),
                                                       download=False, max_train_samples=200,
                                                       max_test_samples=100))
    for mine, own in ((train, own_train), (test, own_test)):
        indices = torch.arange(len(mine))
        images, labels = mine.batch(indices)
        own_images, own_labels = own.batch(indices)
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert torch.equal(labels, own_labels)
        assert torch.allclose(images, own_images, atol=1e-5)
    again = pickle.loads(pickle.dumps(train))  # loader workers are spawned: the set travels pickled
    assert torch.equal(again.batch(torch.tensor([5, 0]))[0], train.batch(torch.tensor([5, 0]))[0])
