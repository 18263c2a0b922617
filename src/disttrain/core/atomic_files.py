"""Files written atomically with a SHA-256 sum, and the check of that sum on reading.

A file is written to a temporary file beside it, fsynced and renamed into place, so a
crash never leaves a partial file under the final name. A file `NAME` so written has its
sum in a sidecar `NAME.sha256`, one line in `sha256sum`'s format (`<hex>  NAME`), so
`sha256sum -c` checks it by hand too; the sum lets a reader tell a truncated or
bit-flipped file from a good one before unpickling it. The sum is taken from the bytes
as they are written (no second copy of the state in memory). A sidecar beside the file,
rather than a sum inside it, keeps a checkpoint a plain `torch.save` file that any
`torch.load` reads. Every file is written with its sidecar, so one without (copied
without it, or its sidecar lost) is refused: its bytes cannot be told from damaged ones.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from disttrain.core import failpoints
from disttrain.core.errors import CheckpointError

SIDECAR_SUFFIX = ".sha256"
HEX_DIGITS = frozenset("0123456789abcdef")


class HashingWriter:
    """A binary file wrapper that hashes every byte written through it (for `torch.save`).

    It keeps the first error its file raised: `torch.save` turns a failed write (a full
    disk) into a `RuntimeError` of its own ("unexpected pos"), and `fill` raises the file's
    error instead, so the disk's error is seen, and retried, as the disk's.
    """

    def __init__(self, handle: BinaryIO):
        self._handle = handle
        self._sha256 = hashlib.sha256()
        self.error: BaseException | None = None

    def write(self, data: bytes) -> int:
        self._sha256.update(data)
        try:
            return self._handle.write(data)
        except BaseException as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self._handle.flush()
        except BaseException as e:
            self.error = self.error or e
            raise

    def fill(self, write: Callable[[HashingWriter], Any]) -> None:
        """Call `write(self)`; when it fails after the file failed, raise the file's error."""
        try:
            write(self)
        except Exception:
            if self.error is not None:
                raise self.error from self.error.__cause__
            raise

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """Write `obj` with `torch.save` to `path` atomically, its SHA-256 to `path`.sha256.

    The order makes a file under its final name always have its sum on disk: the bytes go
    to a temporary file (hashed as they are written) and are fsynced; the sidecar is
    written and renamed into place; only then is the file renamed over `path`. A crash
    between the two renames while *overwriting* `path` leaves the old file beside the new
    sum: loading then reports a checksum mismatch and resuming falls back to the previous
    checkpoint, so the window costs at most one checkpoint, never wrong data.

    The injected checkpoint faults (`core.failpoints`) fire here: a write that fails with
    ENOSPC, a process that dies once the bytes are down and before either rename.

    Raises:
        OSError: the folder is not writable or the disk is full; whatever `torch.save`
            raises for an object it cannot save. Either way `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch  # here, not above: `disttrain report --help` and the like never load torch

    failpoints.checkpoint_write(path)
    temporary, digest = _write_temporary(path, lambda handle: torch.save(obj, handle))
    failpoints.checkpoint_written_partly()  # the bytes are down, nothing is complete yet
    try:
        text = sidecar_text(path.name, digest).encode("ascii")
        sidecar = sidecar_path(path)
        _rename_into_place(_write_temporary(sidecar, lambda handle: handle.write(text))[0], sidecar)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _rename_into_place(temporary, path)
    return path


def write_file_atomic(path: str | Path, write: Callable[[HashingWriter], Any]) -> str:
    """Let `write` fill a temporary file beside `path` (its folder made as needed), fsynced
    and renamed into place, readable by its owner only; returns the SHA-256 of its bytes.
    A `file://` store writes its objects so (see `object_store.StoreFolder`).

    Raises:
        OSError: the folder is not writable or the disk is full (`path` is left as it was);
            whatever `write` raises.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary, digest = _write_temporary(path, write)
    _rename_into_place(temporary, path)
    return digest


def write_bytes_atomic(path: str | Path, data: bytes, mode: int = 0o644) -> Path:
    """Write `data` at `path` atomically, without a sidecar (reports, manifests): the
    folder is created; the file gets `mode` (the temporary file's 0600 would otherwise
    survive the rename and hide a report from everyone but its owner)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary, _ = _write_temporary(path, lambda handle: handle.write(data))
    temporary.chmod(mode)
    _rename_into_place(temporary, path)
    return path


def _write_temporary(path: Path, write: Callable[[HashingWriter], Any]) -> tuple[Path, str]:
    """Let `write` fill a fresh temporary file beside `path`; flush and fsync it.

    Returns:
        The temporary file and the SHA-256 of what was written (the file is removed when
        `write` raises).
    """
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            hashing = HashingWriter(handle)
            hashing.fill(write)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name), hashing.hexdigest()


def _rename_into_place(temporary: Path, path: Path) -> None:
    """Rename and fsync the folder, so the rename is durable before the next one starts."""
    try:
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sidecar_path(path: str | Path) -> Path:
    """Where the sum of `path` is kept."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def sidecar_text(name: str, digest: str) -> str:
    """The sidecar's content for the file `name` whose SHA-256 is `digest`."""
    return f"{digest}  {name}\n"


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of the file at `path`, read in chunks.

    Raises:
        CheckpointError: the file is missing or cannot be read.
    """
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} does not exist") from e
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror}); check its "
                              "permissions and the disk") from e


def expected_sha256(path: str | Path) -> str:
    """The sum recorded for `path` in its sidecar.

    Raises:
        CheckpointError: `path` does not exist; it has no sidecar; or the sidecar cannot
            be read or is malformed.
    """
    sidecar = sidecar_path(path)
    try:
        text = sidecar.read_text(encoding="ascii")
    except FileNotFoundError as e:
        if not Path(path).exists():
            raise CheckpointError(f"checkpoint {path} does not exist") from e
        raise CheckpointError(f"checkpoint {path} has no checksum file {sidecar.name} beside it (every "
                              "checkpoint and model file is written with one); copy it along with the "
                              "checkpoint, or restore a good copy of both") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checksum file {sidecar} cannot be read ({e}); check its "
                              "permissions, or restore a good copy of it with its checkpoint") from e
    return parse_sidecar(text, sidecar)


def parse_sidecar(text: str, sidecar: str | Path) -> str:
    """The SHA-256 recorded in a sidecar's `text` (read from `sidecar`, named in errors).

    Raises:
        CheckpointError: the text does not start with a 64-digit hex sum.
    """
    digest = text.split(maxsplit=1)[0] if text.strip() else ""
    if len(digest) != 64 or not set(digest) <= HEX_DIGITS:
        raise CheckpointError(f"checksum file {sidecar} is malformed (expected a 64-digit SHA-256); "
                              "restore a good copy of it with its checkpoint")
    return digest


def verify_sha256(path: str | Path) -> None:
    """Check `path` against its sidecar.

    Raises:
        CheckpointError: the sum does not match (the message says "corrupt or truncated"
            and "checksum"); the file or its sidecar is missing or cannot be read.
    """
    expected = expected_sha256(path)
    actual = file_sha256(path)
    if actual != expected:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: its SHA-256 checksum "
                              f"{actual[:16]}... does not match {expected[:16]}... recorded in "
                              f"{sidecar_path(path).name}; restore a good copy, or delete it (a resume then "
                              "falls back to the previous checkpoint)")
