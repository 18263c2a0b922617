"""`torchvision:NAME` data sets: names resolved, images normalised, torchvision's layout
read from the data folder, and each way it can fail one line with exit code 2, nothing
started. The tests that need torchvision skip without it (the `vision` extra); the error
without it is shown everywhere, torchvision hidden from the import."""

from __future__ import annotations

import gzip
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

TORCHVISION_NAMES = ["CIFAR10", "CIFAR100", "MNIST", "FashionMNIST", "KMNIST", "SVHN", "STL10", "Flowers102",
                     "VOCSegmentation", "CocoDetection", "Kinetics", "KittiFlow", "ImageFolder"]


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
    for other_task in ("VOCSegmentation", "cocodetection", "Kinetics", "KittiFlow"):
        with pytest.raises(ConfigError, match=r"is not an image-classification set \(its targets are not "
                                              r"one class per image\)"):
            vision.resolve_name(other_task, TORCHVISION_NAMES)
    for classifier in ("STL10", "Flowers102"):  # image classification, but not called as (root, train)
        with pytest.raises(ConfigError, match=rf"torchvision:{classifier} is not one of the sets disttrain "
                                              r"reads by name .*write a data-set factory"):
            vision.resolve_name(classifier, TORCHVISION_NAMES)


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


def torchvision_layout(folder, real_data_dir, own: str, name: str, unpack: bool = False):
    """A data folder in torchvision's layout: the four .gz files of disttrain's `own` copy in
    DIR/NAME/raw/, as a user puts them there by hand: linked, or unpacked."""
    torchvision_or_skip()
    sources = sorted((real_data_dir / own).glob("*-ubyte.gz"))
    if len(sources) != 4:
        pytest.skip(f"no copy of {own} in {real_data_dir}")
    raw = folder / name / "raw"
    raw.mkdir(parents=True)
    for source in sources:
        if unpack:
            (raw / source.stem).write_bytes(gzip.decompress(source.read_bytes()))
        else:
            (raw / source.name).symlink_to(source)
    return folder


# MNIST: the original .gz files, checked against torchvision's MD5s and unpacked with
# downloads off; Fashion-MNIST: a repackaged copy (other .gz bytes), unpacked by hand.
@pytest.mark.parametrize(("name", "own", "unpack"), [("MNIST", "mnist", False),
                                                     ("FashionMNIST", "fashion_mnist", True)])
def test_torchvisions_mnist_sets_are_disttrains_own(name, own, unpack, tmp_path, real_data_dir):
    """Read from torchvision's layout with downloads off, the items are the same normalised
    images and labels as disttrain's own reader gives."""
    folder = torchvision_layout(tmp_path / "tv", real_data_dir, own, name, unpack)
    config = TrainingConfig(dataset=f"torchvision:{name}", data_dir=str(folder), download=False,
                            max_train_samples=200, max_test_samples=100)
    assert describe_dataset(config) == DatasetDescription.classification((1, 28, 28), 10)
    assert (folder / name / "raw" / "train-images-idx3-ubyte").is_file()
    train, test = load_datasets(config)
    assert (len(train), len(test)) == (200, 100) and train.name == f"torchvision:{name}"
    own_train, own_test = load_datasets(TrainingConfig(dataset=own, data_dir=str(real_data_dir),
                                                       download=False, max_train_samples=200,
                                                       max_test_samples=100))
    for mine, theirs in ((train, own_train), (test, own_test)):
        indices = torch.arange(len(mine))
        images, labels = mine.batch(indices)
        own_images, own_labels = theirs.batch(indices)
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert torch.equal(labels, own_labels)
        assert torch.allclose(images, own_images, atol=1e-5)
    again = pickle.loads(pickle.dumps(train))  # loader workers are spawned: the set travels pickled
    assert torch.equal(again.batch(torch.tensor([5, 0]))[0], train.batch(torch.tensor([5, 0]))[0])


def test_an_archive_put_in_place_that_torchvision_would_not_accept_is_named(tmp_path, capsys):
    torchvision = torchvision_or_skip()
    name, md5 = torchvision.datasets.KMNIST.resources[0]
    raw = tmp_path / "data" / "KMNIST" / "raw"
    raw.mkdir(parents=True)
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (raw / f"{stem}.gz").write_bytes(gzip.compress(b"not the data set"))
    line = run_failing(["baseline", "--dataset", "torchvision:KMNIST", "--data-dir", str(tmp_path / "data"),
                        "--set", "training.download=false"], tmp_path, capsys)
    assert (f"{raw / name} is not the file torchvision checks for torchvision:KMNIST (its MD5 is not "
            f"{md5}); put the original there, or unpack it in its place") in line
