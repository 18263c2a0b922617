"""Where the bytes of each data set come from: files on disk, verified downloads, parsers.

Files are read from `<data_dir>/<dataset>/` (gzipped or not). When they are absent and the
machine is online, they are downloaded from the canonical mirrors and checked against
their MD5; offline, a `DataError` says which files to put where. Every parser checks the
header and the byte length, so a truncated file fails with a clear message, never with
garbage tensors.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import struct
import tarfile
import tempfile
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from disttrain.core.errors import DataError

logger = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 30.0

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

# MD5 of the official .gz files, as published with each data set.
IDX_CHECKSUMS = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}
IDX_MIRRORS = {
    "mnist": [
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ],
    "fashion_mnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
}

CIFAR10_ARCHIVE = "cifar-10-binary.tar.gz"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
CIFAR10_TRAIN = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR10_TEST = ["test_batch.bin"]
CIFAR10_RECORD_BYTES = 1 + 3 * 32 * 32


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(urls: list[str], target: Path, md5: str) -> None:
    """Download the first mirror that answers into `target`, atomically, checking the MD5.

    Raises:
        DataError: every mirror failed or returned bytes with the wrong checksum.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for url in urls:
        logger.info("downloading %s", url)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                for chunk in iter(lambda: resp.read(1 << 20), b""):
                    out.write(chunk)
            actual = md5_of(tmp)
            if actual != md5:
                errors.append(f"{url}: checksum {actual} != expected {md5}")
                continue
            os.replace(tmp, target)
            return
        except OSError as e:
            errors.append(f"{url}: {getattr(e, 'reason', e)}")
        finally:
            tmp.unlink(missing_ok=True)
    raise DataError(f"could not download {target.name} ({'; '.join(errors)})")


def _read_maybe_gzip(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(f"{path} is a truncated or corrupt gzip file ({e}); delete it and "
                        "download it again") from e


def parse_idx(data: bytes, source: str) -> np.ndarray:
    """Parse an IDX file of unsigned bytes (MNIST's format) into a uint8 array.

    Raises:
        DataError: bad magic number, unsupported type, or a length that does not match the header.
    """
    if len(data) < 4:
        raise DataError(f"{source} is truncated: {len(data)} bytes, not even an IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08 or not 1 <= ndim <= 4:
        raise DataError(f"{source} is not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{source} is truncated inside its header")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(dims))
    found = len(data) - header
    if found != expected:
        raise DataError(f"{source} is truncated or corrupt: header says {expected} bytes of data "
                        f"for shape {tuple(dims)}, found {found}; delete it and download it again")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def ensure_idx_files(dataset: str, data_dir: Path, allow_download: bool = True) -> dict[str, Path]:
    """Return the four IDX files of `dataset`, downloading any that are missing when allowed.

    Raises:
        DataError: a file is missing and cannot be downloaded; the message says where to put it.
    """
    folder = data_dir / dataset
    paths = {}
    for role, stem in IDX_FILES.items():
        path = _find_idx(folder, stem)
        if path is None:
            target = folder / f"{stem}.gz"
            urls = [mirror + target.name for mirror in IDX_MIRRORS[dataset]]
            try:
                if not allow_download:
                    raise DataError("downloads are off (training.download: false)")
                download(urls, target, IDX_CHECKSUMS[dataset][target.name])
            except DataError as e:
                wanted = ", ".join(f"{s}.gz" for s in IDX_FILES.values())
                raise DataError(f"{dataset}: {stem}[.gz] is not in {folder} and {e}; put the files "
                                f"{wanted} in {folder} (or pass --data-dir)") from e
            path = target
        paths[role] = path
    return paths


def load_idx_dataset(dataset: str, data_dir: Path, allow_download: bool = True
                     ) -> dict[str, np.ndarray]:
    """Load MNIST-format images (N, 28, 28) and labels (N,) for train and test."""
    paths = ensure_idx_files(dataset, data_dir, allow_download)
    arrays = {role: parse_idx(_read_maybe_gzip(path), str(path)) for role, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{dataset}: {split} images {images.shape} and labels {labels.shape} "
                            "do not match; the files are from different data sets or corrupt")
    return arrays


def parse_cifar10_batch(data: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse one CIFAR-10 binary batch: records of 1 label byte + 3x32x32 pixel bytes.

    Raises:
        DataError: the length is not a whole number of records, or a label is out of range.
    """
    if not data or len(data) % CIFAR10_RECORD_BYTES:
        raise DataError(f"{source} is truncated or corrupt: {len(data)} bytes is not a whole "
                        f"number of {CIFAR10_RECORD_BYTES}-byte records")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
    labels = records[:, 0]
    if labels.max() > 9:
        raise DataError(f"{source} has a label {int(labels.max())} outside 0-9; it is corrupt")
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def _cifar10_members(folder: Path, allow_download: bool) -> dict[str, bytes]:
    for candidate in (folder / "cifar-10-batches-bin", folder):
        if all((candidate / name).is_file() for name in CIFAR10_TRAIN + CIFAR10_TEST):
            return {name: (candidate / name).read_bytes() for name in CIFAR10_TRAIN + CIFAR10_TEST}
    archive = folder / CIFAR10_ARCHIVE
    if not archive.is_file():
        try:
            if not allow_download:
                raise DataError("downloads are off (training.download: false)")
            download([CIFAR10_URL], archive, CIFAR10_MD5)
        except DataError as e:
            raise DataError(f"cifar10: the binary batches are not in {folder} and {e}; put "
                            f"{CIFAR10_ARCHIVE} or its cifar-10-batches-bin/ folder there "
                            "(or pass --data-dir)") from e
    members = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and name in CIFAR10_TRAIN + CIFAR10_TEST:
                    members[name] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DataError(f"{archive} is truncated or corrupt ({e}); delete it and download it again") from e
    missing = sorted(set(CIFAR10_TRAIN + CIFAR10_TEST) - set(members))
    if missing:
        raise DataError(f"{archive} lacks {', '.join(missing)}; it is not the binary CIFAR-10 archive")
    return members


def load_cifar10(data_dir: Path, allow_download: bool = True) -> dict[str, np.ndarray]:
    """Load CIFAR-10 (binary version): images (N, 3, 32, 32) uint8 and labels (N,)."""
    folder = data_dir / "cifar10"
    members = _cifar10_members(folder, allow_download)
    out = {}
    for split, names in (("train", CIFAR10_TRAIN), ("test", CIFAR10_TEST)):
        parts = [parse_cifar10_batch(members[name], str(folder / name)) for name in names]
        out[f"{split}_images"] = np.concatenate([images for images, _ in parts])
        out[f"{split}_labels"] = np.concatenate([labels for _, labels in parts])
    return out
