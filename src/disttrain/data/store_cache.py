"""Data sets on object storage: a file at any fsspec URL (`s3://bucket/corpus.txt`,
`gs://...`, `memory://...`, `file://...`), or a folder of them (`image-folder:`), fetched
once into a cache on this machine and read from there as a local file or folder is.

The copy of a URL lives in `training.data_dir`/cache/<key>/<version>, where <key> is
the URL's SHA-256 (its first 16 hex digits) and its last part, and <version> is a digest
of what the store says of the object: its size and its ETag (or the checksum or time of
change its fsspec backend reports). Each process asks the store for that once (one HEAD
on S3); a copy of the same version is read as it is, so a run's processes fetch the
object once between them, and a second run none. A changed object has another version,
so it is fetched again (and said in the log); older versions of the URL are then removed.
A folder's version is a digest of every object's under it (`local_folder`: one listing),
and its copy, `<key>/<version>/<folder's name>/...`, is filled in a temporary folder
renamed into place whole.

A copy is written as a checkpoint is (`atomic_files`): into a temporary file beside it,
fsynced, then renamed into place. Two processes of one machine fetching at once each
write their own temporary file and the second rename replaces the first with the same
bytes; a fetch that dies leaves at most a hidden `.VERSION.*.tmp` file (removed when it
fails in Python; a killed process's stays), never a file under a version's name.
The bytes are checked against the store's size, and against its ETag where that is the
MD5 of the object (a single-part S3 upload); a mismatch (the object replaced during the
fetch) fetches again.

The store is asked through the checkpoint stores' retry window (`store_retry.retried`,
`system.checkpoint_retry_s`): an outage that heals within it costs nothing, one that does
not stops the process with one line (`DataStoreError`, exit code 74). A missing object,
bucket or backend, or refused access, is a user's error: one line naming the URL at once
(`DataSourceError`, exit code 2), in the launcher's first-step check, before any training
process starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain.core import object_store, store_retry
from disttrain.core.atomic_files import write_file_atomic
from disttrain.core.errors import CheckpointStoreError, DataError

logger = logging.getLogger(__name__)

CACHE_FOLDER = "cache"
CHUNK_BYTES = 8 << 20
# What a backend's `info` may say of an object's contents, strongest first; the first one
# present makes, with the size, the object's version.
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "crc32c", "checksum", "LastModified", "last_modified", "mtime",
                  "created")
PLAIN_MD5 = re.compile(r"[0-9a-f]{32}")
# Errors that an attempt again would meet the same way: the user must act.
FINAL_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class DataSourceError(DataError):
    """A data set's URL names no object, a bucket that does not exist, a store whose
    backend is not installed, or one that refuses us. Not recoverable: fix the URL, the
    credentials or install the backend (exit code 2)."""

    exit_code = 2


class DataStoreError(DataError):
    """The data set's store kept failing through the retry window (unreachable,
    throttling). Not recoverable by a restart now: run again once the store works (exit
    code 74, as a checkpoint store's)."""

    exit_code = 74
    recoverable = False


class _Refused(Exception):
    """A backend's own error that is no outage (no credentials, a malformed request)."""


class _LocalError(OSError):
    """The cache folder failed, not the store: not retried."""


def cache_folder(url: str, data_dir: str | Path) -> Path:
    """The folder of `url`'s cached versions under `data_dir`."""
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", object_store.basename(url))[:80] or "object"
    return Path(data_dir) / CACHE_FOLDER / f"{key}-{name}"


def object_version(info: dict[str, Any]) -> str:
    """A digest of what the store says of an object (size and ETag or the like): another
    digest means other bytes."""
    fields = {"size": info.get("size")}
    for field in VERSION_FIELDS:
        if info.get(field) is not None:
            fields[field] = str(info[field])
            break
    text = ";".join(f"{key}={value}" for key, value in fields.items())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def folder_version(listing: dict[str, dict[str, Any]]) -> str:
    """A digest of every object's version under a folder, by its path in it: an object
    added, removed, renamed or changed gives another digest."""
    text = "\n".join(f"{path}={object_version(info)}" for path, info in sorted(listing.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def expected_md5(info: dict[str, Any]) -> str | None:
    """The MD5 of the object's bytes where the store gives it: an S3 ETag of a single-part
    upload is one (a multipart upload's, `...-N`, is not)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    return etag if PLAIN_MD5.fullmatch(etag) else None


def local_copy(url: str, data_dir: str | Path, download: bool = True) -> Path:
    """The path of a complete local copy of the object at `url`, fetched if the cache has
    none of its current version.

    Args:
        url: any fsspec URL of one object (`s3://bucket/corpus.txt`).
        data_dir: `training.data_dir`; the copy goes to its `cache/` folder.
        download: `training.download`; False: only a cached copy of the object's current
            version is read, none is fetched (`--check-config` writes nothing).

    Raises:
        DataSourceError: no such object or bucket, access refused, no credentials, or the
            URL's backend missing (one line naming the URL and the fix); with `download`
            False, no cached copy of the current version.
        DataStoreError: the store kept failing through the retry window.
        DataError: the cache folder cannot be written.
    """
    return _cached(url, data_dir, lambda folder: _fetch_object_once(url, folder, download))


def _cached(url: str, data_dir: str | Path, attempt: Callable[[Path], Path]) -> Path:
    """`attempt(cache folder of url)` through the retry window, its errors as one line."""
    problem = object_store.backend_problem(url)
    if problem is not None:
        raise DataSourceError(f"training.dataset: {problem}")
    folder = cache_folder(url, data_dir)
    started = time.monotonic()
    try:
        return store_retry.retried(lambda: attempt(folder), url, "fetching the data set",
                                   retry_if=_worth_retrying, kind="data set store")
    except CheckpointStoreError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        raise DataStoreError(
            f"training.dataset: {url} could not be fetched for {time.monotonic() - started:.0f}s "
            f"(system.checkpoint_retry_s={store_retry.window_s():g}): {store_retry.describe(cause)}; run "
            "again once the store works") from e
    except FINAL_ERRORS as e:
        raise DataSourceError(f"training.dataset: {url} cannot be read ({_what(e)}); check the bucket and "
                              "object name and that the credentials given may read it") from e
    except _Refused as e:
        raise DataSourceError(f"training.dataset: {url} cannot be read ({e}); check the credentials and "
                              "the store's address") from e
    except OSError as e:  # the local cache, not the store: the store's are retried above
        raise DataError(f"training.dataset: the copy of {url} cannot be written under {folder} "
                        f"({_what(e)}); free space there or choose another --data-dir") from e


def _worth_retrying(error: BaseException) -> bool:
    return store_retry.is_store_error(error) and not isinstance(error, FINAL_ERRORS + (_LocalError,))


def _what(error: BaseException) -> str:
    return store_retry.describe(error.__cause__ if isinstance(error, _LocalError) else error)


def _fetch_object_once(url: str, folder: Path, download: bool) -> Path:
    """One attempt at one object: ask the store for its version; return the cached copy of
    that version, or fetch it."""
    store = _store_of(url)
    path = _path_in(store, url)
    info = _backend(lambda: _info(store.fs, path))
    if info.get("type", "file") != "file":
        raise IsADirectoryError(f"{url} is a folder, not one object")
    version = object_version(info)
    copy = folder / version
    if copy.is_file() and copy.stat().st_size == info.get("size", copy.stat().st_size):
        logger.info("training.dataset: %s read from its cached copy %s", url, copy)
        return copy
    older = _before_fetching(url, folder, download)
    size = _fetch_file(store, path, info, copy, url)
    _remove(older, keep=copy)
    logger.info("training.dataset: fetched %s (%d bytes) into %s", url, size, copy)
    return copy


def _before_fetching(url: str, folder: Path, download: bool) -> list[Path]:
    """Refuse a fetch with downloads off; say when an older version is cached, and return
    the copies of the older versions (removed once the new one is in place)."""
    if not download:
        raise DataSourceError(f"training.dataset: {url} has no copy of its current version under {folder} "
                              "and training.download is false; set training.download=true to fetch it")
    older = [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []
    if older:
        logger.warning("training.dataset: %s changed in the store since it was cached; fetching it again",
                       url)
    return older


def _remove(copies: list[Path], keep: Path) -> None:
    for old in copies:
        if old == keep:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _fetch_file(store: object_store.StoreFolder, path: str, info: dict[str, Any], copy: Path,
                url: str) -> int:
    """Stream the object at `path` into `copy` atomically, checked against `info`; returns
    its size in bytes."""
    md5 = hashlib.md5(usedforsecurity=False)
    size = 0
    store_failed = False

    def read_from_store(call: Any) -> Any:
        nonlocal store_failed
        try:
            return _backend(call)
        except BaseException:
            store_failed = True
            raise

    def fill(handle: Any) -> None:
        nonlocal size, store_failed
        source = read_from_store(lambda: store.fs.open(path, "rb"))
        with source:
            while chunk := read_from_store(lambda: source.read(CHUNK_BYTES)):
                md5.update(chunk)
                size += len(chunk)
                handle.write(chunk)
        wanted_md5 = expected_md5(info)
        if size != info.get("size", size) or (wanted_md5 is not None and md5.hexdigest() != wanted_md5):
            store_failed = True  # checked before the rename: a mismatch never lies under a version's name
            raise OSError(f"{url}: the bytes fetched ({size}, MD5 {md5.hexdigest()}) do not match the "
                          f"store's ({info.get('size')}, ETag {wanted_md5}); the object changed during the "
                          "fetch")

    try:
        write_file_atomic(copy, fill)
    except OSError as e:
        if store_failed:
            raise
        raise _LocalError(str(e)) from e
    return size


def local_folder(url: str, data_dir: str | Path, download: bool = True) -> Path:
    """The path of a complete local copy of the folder (key prefix) at `url` and every
    object under it, fetched if the cache has none of its current version. The copy keeps
    the folder's own name (`.../<version>/<name>`), so it reads as the folder does.

    Args:
        url: any fsspec URL of a folder (`s3://bucket/pets`).
        data_dir: `training.data_dir`; the copy goes to its `cache/` folder.
        download: `training.download`; False: only a cached copy is read, none is fetched.

    Raises:
        DataSourceError, DataStoreError, DataError: as `local_copy`; an empty or absent
            folder is `DataSourceError`.
    """
    url = url.rstrip("/")
    return _cached(url, data_dir, lambda folder: _fetch_folder_once(url, folder, download))


def list_folder(url: str) -> dict[str, dict[str, Any]]:
    """Every object under the folder (key prefix) at `url`, by its path relative to it,
    with what the store says of it (size, ETag), fetching none (one listing, retried as
    `local_copy`'s fetch is).

    Raises:
        DataSourceError, DataStoreError: as `local_copy`; an empty or absent folder is
            `DataSourceError`.
    """
    url = url.rstrip("/")
    return _cached(url, "", lambda _: _listing(url))  # type: ignore[return-value]


def _listing(url: str) -> dict[str, dict[str, Any]]:
    store = object_store.StoreFolder(url)
    listing = _backend(lambda: _find(store.fs, store.root.rstrip("/")))
    if not listing:
        raise FileNotFoundError(f"{url} holds no objects")
    for relative in listing:
        if any(part in ("", ".", "..") for part in relative.split("/")):  # a copy must stay in its folder
            raise _Refused(f"the object {relative!r} has a name that is no path inside the folder")
    return listing


def _fetch_folder_once(url: str, folder: Path, download: bool) -> Path:
    """One attempt at a folder: list it, return the cached copy of that listing or fetch
    every object into a temporary folder renamed into place."""
    store = object_store.StoreFolder(url)
    root = store.root.rstrip("/")
    listing = _listing(url)
    version = folder_version(listing)
    name = object_store.basename(url) or "folder"
    copy = folder / version / name
    if copy.is_dir():
        logger.info("training.dataset: %s read from its cached copy %s", url, copy)
        return copy
    older = _before_fetching(url, folder, download)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".{version}.", suffix=".tmp"))
    except OSError as e:
        raise _LocalError(str(e)) from e
    try:
        size = 0
        for rel, info in sorted(listing.items()):
            size += _fetch_file(store, f"{root}/{rel}", info, staging / name / rel, f"{url}/{rel}")
        try:
            os.rename(staging, folder / version)
        except OSError as e:
            if not copy.is_dir():  # another process renamed the same version in first: take theirs
                raise _LocalError(str(e)) from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove(older, keep=folder / version)
    logger.info("training.dataset: fetched %s (%d objects, %d bytes) into %s", url, len(listing), size, copy)
    return copy


def _find(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """Every object under `root`, by its path relative to it."""
    fs.invalidate_cache(root)
    found = fs.find(root, detail=True)
    return {path[len(root):].lstrip("/"): info for path, info in found.items()
            if info.get("type", "file") == "file" and path.startswith(root + "/")}


def _store_of(url: str) -> object_store.StoreFolder:
    folder = url.rstrip("/").rsplit("/", 1)[0]
    return object_store.StoreFolder(folder)


def _path_in(store: object_store.StoreFolder, url: str) -> str:
    return f"{store.root.rstrip('/')}/{object_store.basename(url)}"


def _info(fs: Any, path: str) -> dict[str, Any]:
    fs.invalidate_cache(path)  # the object may have changed since this process last asked
    return fs.info(path)


def _backend(call: Any) -> Any:
    with _backend_errors():
        return call()


class _backend_errors:  # noqa: N801 - a context manager, used as `with _backend_errors():`
    """A backend's own error (botocore's, aiohttp's) as an `OSError` when it is an outage
    (a connection, a timeout: retried), as `_Refused` otherwise (no credentials: said at once)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is None or isinstance(error, OSError) or type(error).__module__ == "builtins" \
                or not isinstance(error, Exception):
            return False
        if store_retry.is_transient(error):
            raise object_store.StoreError(store_retry.describe(error)) from error
        raise _Refused(store_retry.describe(error)) from error
