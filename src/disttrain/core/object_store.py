"""Checkpoint folders on object storage: any fsspec URL (`s3://`, `gs://`, `file://`, `memory://`).

A store has no rename that is atomic across objects, and an upload cut short may, on some
stores, leave a partial object behind. So a checkpoint on a store is complete only once its
SHA-256 sidecar (`NAME.sha256`, the same format as on disk) is there *and* matches: the
data object is written first, its sidecar last, and a reader treats a data object without
a sidecar, or with one that does not match, as absent (it is never chosen as the latest).
Overwriting a checkpoint removes its old sidecar before the new data goes up, so an old sum
never vouches for new bytes. Unlike a local file, a checkpoint on a store needs its
sidecar: there are no checkpoints on stores written before sums existed.

Objects are streamed as they are written (`torch.save` into the store's file), hashed on
the way, so no second copy of the state is held in memory; they are read back whole
(`cat_file`) and loaded from those bytes with `torch.load(weights_only=True)`.

A plain path (no `scheme://`) is never a URL here: local folders keep their own code
(`atomic_files`, rename and fsync). `join`, `exists`, `read_bytes` and `write_bytes` take
either, so the strategies' code names one location whatever it is (a parameter-server
worker's key file, the object a DDP rank checks before loading).
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain.core.atomic_files import (
    SIDECAR_SUFFIX,
    HashingWriter,
    parse_sidecar,
    sidecar_text,
    write_bytes_atomic,
)
from disttrain.core.errors import CheckpointError

logger = logging.getLogger(__name__)

# The extra of this package that installs a scheme's fsspec backend.
EXTRA_OF_SCHEME = {"s3": "s3", "s3a": "s3"}


def is_url(location: str | Path) -> bool:
    """True when `location` names a store (`scheme://...`), False for a plain local path."""
    return isinstance(location, str) and "://" in location and not location.startswith("/")


def join(folder: str | Path, name: str) -> str | Path:
    """`folder`/`name`: a URL stays a URL (`Path` would fold `s3://` into `s3:/`)."""
    if is_url(folder):
        return f"{str(folder).rstrip('/')}/{name}"
    return Path(folder) / name


def basename(location: str | Path) -> str:
    """The last part of a path or URL."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def backend_problem(url: str) -> str | None:
    """Why `url`'s scheme cannot be used here (unknown, or its backend not installed), or None.

    Call at config time: the message names the package or extra to install.
    """
    scheme = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError:
        return f"{url!r} is a URL, which needs fsspec: pip install 'disttrain[s3]' (or fsspec)"
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        return (f"{url!r}: unknown storage scheme {scheme!r}; use s3://, gs://, file://, memory:// "
                "(any fsspec protocol) or a local path")
    except ImportError as e:
        extra = EXTRA_OF_SCHEME.get(scheme)
        fix = f"pip install 'disttrain[{extra}]'" if extra else f"install its fsspec backend ({e})"
        return f"{url!r}: the {scheme}:// backend is not installed; {fix}"
    return None


def exists(location: str | Path) -> bool:
    """Whether the file or object at `location` is there (on a store: listed in its folder)."""
    if not is_url(location):
        return Path(location).is_file()
    folder, name = _split(str(location))
    return name in StoreFolder(folder).names()


def read_bytes(location: str | Path) -> bytes:
    """The bytes of a small file or object that is not a checkpoint (no sidecar: a key, a note).

    Raises:
        OSError: it cannot be read (FileNotFoundError when absent); on a store, the store's
            own errors as s3fs and the like translate them.
    """
    if not is_url(location):
        return Path(location).read_bytes()
    folder, name = _split(str(location))
    return StoreFolder(folder).read(name)


def write_bytes(location: str | Path, data: bytes, mode: int = 0o644) -> str | Path:
    """Write a small file or object that is not a checkpoint, whole or not at all.

    A local file is written atomically with `mode` (`atomic_files.write_bytes_atomic`). On a
    store it is one object, which a store shows whole or not at all; `mode` does not apply
    there: who may read it is the bucket's policy.

    Returns:
        `location`.

    Raises:
        OSError (or the store's own errors): the write failed.
    """
    if not is_url(location):
        return write_bytes_atomic(location, data, mode=mode)
    folder, name = _split(str(location))
    StoreFolder(folder).write(name, lambda handle: handle.write(data))
    return location


def _split(url: str) -> tuple[str, str]:
    """A URL's folder and its last part."""
    folder, name = url.rstrip("/").rsplit("/", 1)
    return folder, name


class StoreFolder:
    """One folder (a key prefix) of a store, with the few operations checkpoints need.

    Args:
        url: the folder, e.g. `s3://bucket/run/checkpoints`.

    Raises:
        CheckpointError: the URL's backend is missing or unknown.
    """

    def __init__(self, url: str):
        problem = backend_problem(url)
        if problem is not None:
            raise CheckpointError(problem)
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def names(self) -> list[str]:
        """The names of the objects directly in the folder (none when it does not exist)."""
        self.fs.invalidate_cache(self.root)  # another process may have written since we looked
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(basename(entry) for entry in entries)

    def read(self, name: str) -> bytes:
        """The object's bytes. Raises FileNotFoundError when it is absent."""
        return self.fs.cat_file(self._path(name))

    def write(self, name: str, fill: Callable[[Any], Any]) -> str:
        """Let `fill` stream the object `name` into the store; returns the SHA-256 of its bytes.

        A failed write is removed where the store let a part of it through (a reader would
        skip it anyway: it has no sidecar).
        """
        path = self._path(name)
        try:
            with self.fs.open(path, "wb") as handle:
                hashing = HashingWriter(handle)
                fill(hashing)
        except BaseException:
            self.remove(name)
            raise
        return hashing.hexdigest()

    def remove(self, name: str) -> None:
        """Remove the object; nothing when it is absent."""
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"


def save(obj: Any, url: str) -> str:
    """Write `obj` with `torch.save` at `url`, then its sidecar: complete only once both are up.

    Returns:
        `url`.

    Raises:
        OSError (or the store's own errors): the store refused or could not be reached;
            the checkpoint is then not complete, and never read as one.
    """
    import torch  # here, not above: `disttrain report --help` and the like never load torch

    folder, name = _split(url)
    store = StoreFolder(folder)
    store.remove(name + SIDECAR_SUFFIX)  # the old sum must not vouch for the new bytes
    digest = store.write(name, lambda handle: torch.save(obj, handle))
    text = sidecar_text(name, digest).encode("ascii")
    store.write(name + SIDECAR_SUFFIX, lambda handle: handle.write(text))
    return url


def complete_names(store: StoreFolder, names: list[str]) -> list[str]:
    """Those of `names` whose sidecar is in the folder too (checked, not yet verified)."""
    present = set(store.names())
    return [name for name in names if name + SIDECAR_SUFFIX in present]


def load_bytes(url: str) -> bytes:
    """The bytes of the checkpoint at `url`, verified against its sidecar.

    Raises:
        CheckpointError: the object or its sidecar is missing (an upload that did not
            finish), the sidecar is malformed, or the sum does not match.
    """
    folder, name = _split(url)
    store = StoreFolder(folder)
    try:
        sidecar = store.read(name + SIDECAR_SUFFIX)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {url} has no {SIDECAR_SUFFIX} sidecar: its upload did not "
                              "finish, so it is not a checkpoint") from e
    expected = parse_sidecar(sidecar.decode("ascii", errors="replace"), url + SIDECAR_SUFFIX)
    try:
        data = store.read(name)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {url} does not exist") from e
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CheckpointError(f"checkpoint {url} is corrupt or truncated: its SHA-256 checksum "
                              f"{actual[:16]}... does not match {expected[:16]}... recorded in "
                              f"{name}{SIDECAR_SUFFIX}; a resume falls back to the previous checkpoint")
    return data


def load_buffer(url: str) -> io.BytesIO:
    """`load_bytes` as a buffer for `torch.load`."""
    return io.BytesIO(load_bytes(url))
