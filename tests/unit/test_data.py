"""Data sets and their parsers: real digits, synthetic, IDX and CIFAR-10 files written here."""

import gzip
import struct
import tarfile

import numpy as np
import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.core.errors import DataError
from disttrain.data import datasets, load_datasets, sources


def write_idx(path, array: np.ndarray, compress=True, cut=0):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = (header + array.astype(np.uint8).tobytes())
    data = data[:len(data) - cut]
    path.write_bytes(gzip.compress(data) if compress else data)


def make_idx_dataset(folder, num_train=20, num_test=10, compress=True):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", num_train), ("t10k", num_test)):
        suffix = ".gz" if compress else ""
        write_idx(folder / f"{split}-images-idx3-ubyte{suffix}",
                  rng.integers(0, 256, (count, 28, 28)), compress)
        write_idx(folder / f"{split}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, (count,)),
                  compress)


def test_digits_is_real_and_split():
    train, test = load_datasets(TrainingConfig(dataset="digits"))
    assert train.input_shape == (1, 8, 8) and len(train) + len(test) == 1797
    assert abs(float(train.images.mean())) < 1e-4  # normalised by the train split
    # UCI's optdigits test set: these many images of each digit, 0 to 9
    counts = torch.bincount(torch.cat([train.labels, test.labels]), minlength=10)
    assert counts.tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


@pytest.mark.parametrize("content", [b"", gzip.compress(b"1,2,3\n", mtime=0),
                                     gzip.compress(b"99," * 64 + b"1\n", mtime=0)],
                         ids=["empty", "too-few-columns", "pixel-out-of-range"])
@pytest.mark.filterwarnings("error")  # the error's line alone, no warning of numpy's beside it
def test_a_damaged_digits_file_is_a_clear_error(tmp_path, monkeypatch, content):
    damaged = tmp_path / "digits.csv.gz"
    damaged.write_bytes(content)
    monkeypatch.setattr(datasets, "DIGITS_FILE", damaged)
    with pytest.raises(DataError, match="digits data set shipped with disttrain .*reinstall disttrain"):
        load_datasets(TrainingConfig(dataset="digits"))


def test_synthetic_is_deterministic_and_sized():
    a, _ = load_datasets(TrainingConfig(dataset="synthetic", num_samples=64))
    b, test = load_datasets(TrainingConfig(dataset="synthetic", num_samples=64))
    assert len(a) == 64 and len(test) == 12 and a.input_shape == (1, 28, 28)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_subsets_are_deterministic():
    config = TrainingConfig(dataset="digits", max_train_samples=100, max_test_samples=30)
    train, test = load_datasets(config)
    again, _ = load_datasets(config)
    assert len(train) == 100 and len(test) == 30
    assert torch.equal(train.labels, again.labels)
    assert len(train.labels.unique()) == 10  # a permutation, not the first 100 in file order


@pytest.mark.parametrize("compress", [True, False])
def test_idx_files_gzipped_or_not(tmp_path, compress):
    make_idx_dataset(tmp_path / "mnist", compress=compress)
    train, test = load_datasets(TrainingConfig(dataset="mnist", data_dir=str(tmp_path)))
    assert len(train) == 20 and len(test) == 10 and train.input_shape == (1, 28, 28)
    assert train.labels.dtype == torch.int64


def test_truncated_idx_file_is_named(tmp_path):
    make_idx_dataset(tmp_path / "mnist")
    write_idx(tmp_path / "mnist" / "train-images-idx3-ubyte.gz",
              np.zeros((20, 28, 28)), compress=True, cut=100)
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz is truncated or corrupt"):
        load_datasets(TrainingConfig(dataset="mnist", data_dir=str(tmp_path)))


def test_truncated_gzip_is_named(tmp_path):
    make_idx_dataset(tmp_path / "mnist")
    target = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    target.write_bytes(target.read_bytes()[:15])
    with pytest.raises(DataError, match="truncated or corrupt gzip"):
        load_datasets(TrainingConfig(dataset="mnist", data_dir=str(tmp_path)))


def test_not_an_idx_file():
    with pytest.raises(DataError, match="not an IDX file"):
        sources.parse_idx(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, "x.png")


def test_missing_files_offline_say_where_to_put_them(tmp_path, monkeypatch):
    def offline(urls, target, md5):
        raise DataError(f"could not download {target.name} (no network)")

    monkeypatch.setattr(sources, "download", offline)
    with pytest.raises(DataError) as info:
        load_datasets(TrainingConfig(dataset="fashion_mnist", data_dir=str(tmp_path / "nowhere")))
    message = str(info.value)
    assert "train-images-idx3-ubyte.gz" in message and str(tmp_path / "nowhere" / "fashion_mnist") in message


def test_download_checks_the_checksum(tmp_path):
    payload = tmp_path / "served.bin"
    payload.write_bytes(b"not the real file")
    with pytest.raises(DataError, match="checksum"):
        sources.download([payload.as_uri()], tmp_path / "out.gz", "0" * 32)
    assert not (tmp_path / "out.gz").exists()
    sources.download([payload.as_uri()], tmp_path / "out.gz", sources.md5_of(payload))
    assert (tmp_path / "out.gz").read_bytes() == b"not the real file"


def cifar_batch(count, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, (count, 1), dtype=np.uint8)
    pixels = rng.integers(0, 256, (count, 3072), dtype=np.uint8)
    return np.concatenate([labels, pixels], axis=1).tobytes()


def test_cifar10_from_extracted_folder_and_archive(tmp_path):
    names = sources.CIFAR10_TRAIN + sources.CIFAR10_TEST
    folder = tmp_path / "a" / "cifar10" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        (folder / name).write_bytes(cifar_batch(4, i))
    train, test = load_datasets(TrainingConfig(dataset="cifar10", data_dir=str(tmp_path / "a")))
    assert len(train) == 20 and len(test) == 4 and train.input_shape == (3, 32, 32)

    archive_dir = tmp_path / "b" / "cifar10"
    archive_dir.mkdir(parents=True)
    with tarfile.open(archive_dir / sources.CIFAR10_ARCHIVE, "w:gz") as tar:
        for name in names:
            tar.add(folder / name, arcname=f"cifar-10-batches-bin/{name}")
    again, _ = load_datasets(TrainingConfig(dataset="cifar10", data_dir=str(tmp_path / "b")))
    assert torch.equal(train.images, again.images)


def test_truncated_cifar10_batch_is_named(tmp_path):
    folder = tmp_path / "cifar10"
    folder.mkdir()
    for i, name in enumerate(sources.CIFAR10_TRAIN + sources.CIFAR10_TEST):
        (folder / name).write_bytes(cifar_batch(2, i)[: -7 if name == "test_batch.bin" else None])
    with pytest.raises(DataError, match="test_batch.bin is truncated"):
        load_datasets(TrainingConfig(dataset="cifar10", data_dir=str(tmp_path)))
