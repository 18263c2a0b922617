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

Every operation on a store is retried with back-off while the store fails, for the
process's retry window, then stops the process with one line (`store_retry`); a backend's
own errors (botocore's...) count as store errors (`StoreError`). A store with folders
(`file://`, `memory://`) gets its folder made before a write; a bucket is never created.

A plain path (no `scheme://`) is never a URL here: local folders keep their own code
(`atomic_files`, rename and fsync). `join`, `exists`, `read_bytes` and `write_bytes` take
either, so the strategies' code names one location whatever it is (a parameter-server
worker's key file, the object a DDP rank checks before loading).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from disttrain.core import failpoints, store_retry
from disttrain.core.atomic_files import (
    SIDECAR_SUFFIX,
    HashingWriter,
    parse_sidecar,
    sidecar_text,
    write_bytes_atomic,
    write_file_atomic,
)
from disttrain.core.errors import CheckpointError

logger = logging.getLogger(__name__)

# The extra of this package that installs a scheme's fsspec backend.
EXTRA_OF_SCHEME = {"s3": "s3", "s3a": "s3"}
# Protocols of stores whose folders are only key prefixes: nothing to make before a write
# (s3fs's makedirs would create a missing bucket).
BUCKET_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "oci", "r2"})


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


def _connect(url: str) -> tuple[Any, str]:
    """`url`'s filesystem and path in it; on S3, made to try each request once.

    botocore retries a cut connection inside each request, and s3fs retries the request
    5 times more: measured against a server that closes every connection, one listing
    made 60 connections over 83 s before it failed. The store's outages were hidden from
    `store_retry`, and the retry window (`system.checkpoint_retry_s`) did not bound the
    wait. With one attempt of each, the error comes back within a second (4 connections,
    aiohttp's own) and `store_retry` alone retries it, logged and within the window; a
    throttled request (SlowDown) is a store error it retries too. The user's own choice
    is kept: `retries` in fsspec's configuration for s3, or AWS_MAX_ATTEMPTS.
    """
    import fsspec

    scheme = url.split("://", 1)[0].lower()
    client = dict(fsspec.config.conf.get(scheme, {}).get("config_kwargs", {}))
    if scheme not in EXTRA_OF_SCHEME or "retries" in client or "AWS_MAX_ATTEMPTS" in os.environ:
        return fsspec.core.url_to_fs(url)
    client["retries"] = {"max_attempts": 1}
    fs, root = fsspec.core.url_to_fs(url, config_kwargs=client)
    fs.retries = 1  # s3fs's retries of a request: a class attribute, not an option
    return fs, root


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
    """Whether the file or object at `location` is there (on a store: listed in its folder).

    Raises:
        CheckpointStoreError: the store could not be listed through the retry window.
    """
    if not is_url(location):
        return Path(location).is_file()
    folder, name = _split(str(location))
    return name in StoreFolder(folder).names()


def read_bytes(location: str | Path) -> bytes:
    """The bytes of a small file or object that is not a checkpoint (no sidecar: a key, a note).

    Raises:
        FileNotFoundError: it is absent.
        OSError: a local file cannot be read.
        CheckpointStoreError: the store failed through the retry window.
    """
    if not is_url(location):
        return Path(location).read_bytes()
    folder, name = _split(str(location))
    return StoreFolder(folder).read(name)


def write_bytes(location: str | Path, data: bytes, mode: int = 0o644) -> str | Path:
    """Write a small file or object that is not a checkpoint, whole or not at all.

    A local file is written atomically with `mode` (`atomic_files.write_bytes_atomic`), its
    folder made as needed. On a store it is one object, which a store shows whole or not at
    all; `mode` does not apply there: who may read it is the bucket's policy.

    Returns:
        `location`.

    Raises:
        CheckpointStoreError: the write kept failing through the retry window.
    """
    if not is_url(location):
        path = Path(location)
        return store_retry.retried(lambda: write_bytes_atomic(path, data, mode=mode), path.parent,
                                   f"writing {path.name}")
    folder, name = _split(str(location))
    StoreFolder(folder).write(name, lambda handle: handle.write(data))
    return location


def _split(url: str) -> tuple[str, str]:
    """A URL's folder and its last part."""
    folder, name = url.rstrip("/").rsplit("/", 1)
    return folder, name


class StoreError(OSError):
    """An error a store's backend raised in its own type (botocore's, aiohttp's...), as an
    `OSError`, so it is retried like any other store error: its type and message are in the
    text, the original is the cause."""


@contextlib.contextmanager
def _backend_errors() -> Iterator[None]:
    """Let `OSError` and Python's own errors through; turn a backend's own into `StoreError`."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        if type(e).__module__ == "builtins":  # a ValueError or TypeError is a bug, not the store
            raise
        raise StoreError(store_retry.describe(e)) from e


class _GuardedHandle:
    """A store's file whose write errors come out as `StoreError` (see `_backend_errors`)."""

    def __init__(self, handle: Any):
        self._handle = handle

    def write(self, data: bytes) -> int:
        with _backend_errors():
            return self._handle.write(data)

    def flush(self) -> None:
        with _backend_errors():
            self._handle.flush()


class StoreFolder:
    """One folder (a key prefix) of a store, with the few operations checkpoints need.

    Each operation is retried through the process's retry window while the store fails
    (`store_retry.retried`), then raises `CheckpointStoreError`; its `_once` form tries once.
    A store with folders (`memory://`, sftp...) gets the folder made before a write; a
    bucket store (`s3://`, `gs://`...) has none, and its bucket is never created here (a
    wrong bucket name must fail, not make a bucket). A `file://` folder is this machine's:
    its objects are written as a local folder's files are (`atomic_files`: a temporary
    file renamed into place, fsynced, readable by its owner only; the folder made).

    Args:
        url: the folder, e.g. `s3://bucket/run/checkpoints`.

    Raises:
        CheckpointError: the URL's backend is missing or unknown.
    """

    def __init__(self, url: str):
        problem = backend_problem(url)
        if problem is not None:
            raise CheckpointError(problem)
        self.url = url.rstrip("/")
        self.fs, self.root = _connect(self.url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._has_folders = not BUCKET_STORES.intersection(protocols)
        # This machine's folder, for a `file://` URL (None for any other store).
        self.local_root = Path(self.root) if "file" in protocols else None
        _quiet_background_errors(self.fs)

    def names(self) -> list[str]:
        """The names of the objects directly in the folder (none when it does not exist)."""
        return store_retry.retried(self.names_once, self.url, "listing the folder")

    def names_once(self) -> list[str]:
        """`names`, tried once."""
        with _backend_errors():
            self.fs.invalidate_cache(self.root)  # another process may have written since we looked
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted(basename(entry) for entry in entries)

    def read(self, name: str) -> bytes:
        """The object's bytes. Raises FileNotFoundError at once when it is absent."""
        return store_retry.retried(lambda: self.read_once(name), self.url, f"reading {name}",
                                   retry_if=_absent_is_no_failure)

    def read_once(self, name: str) -> bytes:
        """`read`, tried once."""
        with _backend_errors():
            return self.fs.cat_file(self._path(name))

    def write(self, name: str, fill: Callable[[Any], Any]) -> str:
        """Let `fill` stream the object `name` into the store; returns the SHA-256 of its bytes.

        A failed write is removed where the store let a part of it through (a reader would
        skip it anyway: it has no sidecar). An error of `fill` itself (an object that
        cannot be pickled) is raised at once, not retried.
        """
        return store_retry.retried(lambda: self.write_once(name, fill), self.url, f"writing {name}")

    def write_once(self, name: str, fill: Callable[[Any], Any]) -> str:
        """`write`, tried once."""
        path = self._path(name)
        if self.local_root is not None:
            return write_file_atomic(self.local_root / name, fill)
        try:
            with _backend_errors():
                if self._has_folders:
                    self.fs.makedirs(self.root, exist_ok=True)
                handle = self.fs.open(path, "wb")
            try:
                hashing = HashingWriter(_GuardedHandle(handle))
                hashing.fill(fill)
            except BaseException:
                with contextlib.suppress(Exception):
                    handle.close()  # whatever part it sends is removed below
                raise
            with _backend_errors():
                handle.close()  # a store's upload happens here
        except BaseException:
            self._remove_quietly(name)
            raise
        return hashing.hexdigest()

    def remove(self, name: str) -> None:
        """Remove the object; nothing when it is absent."""
        store_retry.retried(lambda: self.remove_once(name), self.url, f"removing {name}")

    def remove_once(self, name: str) -> None:
        """`remove`, tried once."""
        with _backend_errors():
            try:
                self.fs.rm_file(self._path(name))
            except FileNotFoundError:
                pass

    def _remove_quietly(self, name: str) -> None:
        """Remove what a failed write left, if the store lets us now (it may be the store
        that failed: the error to report is the write's)."""
        try:
            self.remove_once(name)
        except Exception as e:
            logger.debug("could not remove %s/%s after a failed write: %s", self.url, name, e)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"


def _quiet_background_errors(fs: Any) -> None:
    """An async backend's event loop (s3fs's aiohttp) logs an upload cut short a second
    time, as a task whose exception nobody retrieved, with its traceback. The error the
    call raised is the one the run retries and reports; that echo goes to DEBUG."""
    loop = getattr(fs, "loop", None)
    if loop is None or not hasattr(loop, "set_exception_handler") or loop.get_exception_handler() is not None:
        return

    def handler(loop: Any, context: dict[str, Any]) -> None:
        error = context.get("exception")
        logger.debug("store backend: %s%s", context.get("message", "an error in its event loop"),
                     f" ({store_retry.describe(error)})" if error is not None else "",
                     exc_info=error if logger.isEnabledFor(logging.DEBUG) else None)

    loop.set_exception_handler(handler)


def _absent_is_no_failure(error: BaseException) -> bool:
    """Retry a read on a store error, but not on the object's absence: that is an answer."""
    return store_retry.is_store_error(error) and not isinstance(error, FileNotFoundError)


def save(obj: Any, url: str) -> str:
    """Write `obj` with `torch.save` at `url`, then its sidecar: complete only once both are up.

    Returns:
        `url`.

    Raises:
        CheckpointStoreError: the store refused or could not be reached through the retry
            window; the checkpoint is then not complete, and never read as one.
        Whatever `torch.save` raises for an object it cannot save, at once.
    """
    import torch  # here, not above: `disttrain report --help` and the like never load torch

    folder, name = _split(url)
    store = StoreFolder(folder)
    store.remove(name + SIDECAR_SUFFIX)  # the old sum must not vouch for the new bytes

    def fill(handle: Any) -> None:
        failpoints.checkpoint_write(url)  # an injected full store fails each try, as a real one
        torch.save(obj, handle)

    digest = store.write(name, fill)
    failpoints.checkpoint_written_partly()  # the data is up, its sidecar not: no checkpoint yet
    text = sidecar_text(name, digest).encode("ascii")
    store.write(name + SIDECAR_SUFFIX, lambda handle: handle.write(text))
    return url


def load_bytes(url: str) -> bytes:
    """The bytes of the checkpoint at `url`, verified against its sidecar.

    Raises:
        CheckpointError: the object or its sidecar is missing (an upload that did not
            finish), the sidecar is malformed, or the sum does not match.
        CheckpointStoreError: the store could not be read through the retry window.
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
