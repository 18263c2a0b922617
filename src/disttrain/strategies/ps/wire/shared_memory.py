"""Same-host payload transport: gradient and parameter bytes through shared memory.

When a worker and a server run on one machine, pushing tensor bytes through gRPC costs
HTTP/2 framing and several copies per byte in each process; a shared mapping costs one
copy on each side. gRPC still carries every message (headers, layout, versions,
outcomes, errors); only the payload bytes move through the mapping, and the message
says so (`shared_memory: true`, empty `payload.data`).

At registration a worker asks for segments; the server creates two per worker and shard
under /dev/shm (owner-only permissions, exclusive create, a random name and a random
nonce written at the start): one the worker writes gradients into, one the server
writes parameters into. The worker maps both, checks the nonce (a worker on another
machine, or in another IPC namespace, finds no file or another nonce, and falls back to
gRPC bytes), then removes the names: the mappings live on, and nothing is left in
/dev/shm whatever happens to either process later. Segments are made only for a worker
whose connection comes from this host; a server removes its segments when it stops,
and those of its user's dead servers (their pid is in the name) when it starts.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
from pathlib import Path

import torch

from disttrain.strategies.ps.wire.codec import decode_tensor

logger = logging.getLogger(__name__)

SEGMENT_DIR = Path("/dev/shm")
NONCE_BYTES = 16
# The payload starts on a cache line, after the nonce.
HEADER_BYTES = 64
# disttrain-<pid of the creating server>-<random>-<role>
_NAME = re.compile(r"^disttrain-([0-9]+)-[0-9a-f]{32}-(gradient|parameter)$")


class SharedMemoryUnavailable(OSError):
    """The segment cannot be created or mapped here (another host, no /dev/shm, ...).
    Recoverable: the payload goes through gRPC instead."""


def available() -> bool:
    """Whether this machine offers POSIX shared memory where segments are made."""
    return SEGMENT_DIR.is_dir() and os.access(SEGMENT_DIR, os.W_OK)


def sweep_stale() -> int:
    """Remove the segments this user's servers left behind when they died before their
    workers attached (a server that stops removes its own); returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(SEGMENT_DIR))
    except OSError:
        return 0
    for entry in entries:
        match = _NAME.match(entry.name)
        try:
            if match is None or entry.stat(follow_symlinks=False).st_uid != os.getuid() \
                    or _alive(int(match.group(1))):
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    if removed:
        logger.info("removed %d shared-memory segment(s) left by stopped servers", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid
        return True
    return True


class Segment:
    """A shared mapping of `nbytes` payload bytes, created by one process and attached
    by another. `tensor(dtype)` views the payload bytes without a copy."""

    def __init__(self, path: Path, mapping: mmap.mmap, nbytes: int, nonce: bytes):
        self.path = path
        self.nbytes = nbytes
        self.nonce = nonce
        self._mapping = mapping
        self._named = True

    @classmethod
    def create(cls, nbytes: int, role: str, nonce: bytes) -> Segment:
        """Create a new segment for `role` ("gradient" or "parameter") marked with `nonce`.

        Raises:
            SharedMemoryUnavailable: no shared memory here, or it is full.
        """
        path = SEGMENT_DIR / f"disttrain-{os.getpid()}-{secrets.token_hex(16)}-{role}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise SharedMemoryUnavailable(f"cannot create {path}: {e}") from e
        try:
            # Reserve the pages now: a sparse file on a full /dev/shm (64 MB in a default
            # container) would kill the process with SIGBUS at the first write instead.
            os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
            mapping = mmap.mmap(fd, HEADER_BYTES + nbytes)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise SharedMemoryUnavailable(f"cannot size {path} to {nbytes} bytes: {e}") from e
        finally:
            os.close(fd)
        mapping[:NONCE_BYTES] = nonce
        return cls(path, mapping, nbytes, nonce)

    @classmethod
    def attach(cls, path: str, nbytes: int, nonce: bytes) -> Segment:
        """Map a segment another process created, checking its size and nonce.

        Raises:
            SharedMemoryUnavailable: no such segment here, or not the one that was meant.
        """
        candidate = Path(path)
        if candidate.parent != SEGMENT_DIR or not _NAME.match(candidate.name):
            raise SharedMemoryUnavailable(f"{path!r} is not a segment name this project makes")
        try:
            fd = os.open(candidate, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise SharedMemoryUnavailable(f"cannot open {path}: {e}") from e
        try:
            if os.fstat(fd).st_size != HEADER_BYTES + nbytes:
                raise SharedMemoryUnavailable(f"{path} does not hold {nbytes} payload bytes")
            mapping = mmap.mmap(fd, HEADER_BYTES + nbytes)
        finally:
            os.close(fd)
        if mapping[:NONCE_BYTES] != nonce:
            mapping.close()
            raise SharedMemoryUnavailable(f"{path} belongs to another run")
        return cls(candidate, mapping, nbytes, nonce)

    def tensor(self, dtype: str | torch.dtype) -> torch.Tensor:
        """The payload bytes as a 1-D tensor of `dtype` (shares memory with the segment)."""
        return decode_tensor(memoryview(self._mapping)[HEADER_BYTES:], dtype)

    def unlink(self) -> None:
        """Remove the name (once); mappings, this one and the peer's, stay valid."""
        if self._named:
            self._named = False
            self.path.unlink(missing_ok=True)


class SegmentPair:
    """The two segments of one worker and shard: gradients in, parameters out."""

    def __init__(self, gradient: Segment, parameter: Segment, dtype: str):
        self.gradient = gradient
        self.parameter = parameter
        self.gradient_tensor = gradient.tensor(dtype)
        self.parameter_tensor = parameter.tensor(dtype)

    @classmethod
    def create(cls, nbytes: int, dtype: str) -> SegmentPair:
        nonce = secrets.token_bytes(NONCE_BYTES)
        gradient = Segment.create(nbytes, "gradient", nonce)
        try:
            parameter = Segment.create(nbytes, "parameter", nonce)
        except SharedMemoryUnavailable:
            gradient.unlink()
            raise
        return cls(gradient, parameter, dtype)

    @classmethod
    def attach(cls, offer, nbytes: int, dtype: str) -> SegmentPair:
        """Map the segments of a `SharedMemoryOffer` and remove their names.

        Raises:
            SharedMemoryUnavailable: they cannot be mapped from this process.
        """
        gradient = Segment.attach(offer.gradient_path, nbytes, offer.nonce)
        parameter = Segment.attach(offer.parameter_path, nbytes, offer.nonce)
        pair = cls(gradient, parameter, dtype)
        pair.unlink()
        return pair

    def unlink(self) -> None:
        self.gradient.unlink()
        self.parameter.unlink()
