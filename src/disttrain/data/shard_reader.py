"""Reading array shards lazily from a store: a bounded cache on disk, a bounded set of shards
in memory, and the next shards of this process's order fetched ahead by a thread.

A shard is fetched whole (every object of a shard of several, `members`: a group of
images of `data.image_stream`) the first time a batch needs it (or ahead of that) into
`training.data_dir`/cache/ through `store_cache.local_copy` (atomic, checked against the
store's size and ETag, retried through `system.checkpoint_retry_s`), then its arrays are
read with `numpy.load(allow_pickle=False)` (no code in a shard can run; a shard of several
objects by its `decode`) and held in memory.

Bounds:

- disk (`training.shard_cache_bytes`, 0: none): after each fetch, the copies of this data
  set's shards on disk are summed, and the least recently used (by this process; copies
  it has not used first, oldest first) are removed until the sum is within the bound. A
  shard being read is never removed by its own process; one removed by another process
  of the machine between its fetch and its read is fetched again.
- memory (`training.num_shards_in_memory`): the least recently used shard is dropped once
  more are held, but never one the batch being read needs or one read ahead for the next
  batches (a batch spanning two shards may hold one more for its time).

Read-ahead (`training.num_shards_ahead`, 0: none): `plan(shards)` gives the order this
process will read its shards in (the training loop gives it each epoch's batches); each
batch moves a cursor along it, and the next shards after the cursor that are not in
memory are fetched and read by one background thread. Without a plan (the test split, a
redone block) the next shards by number are read ahead. A step that needs a shard being
read ahead waits for that read; one that needs a shard nobody is reading reads it itself.
`stats` counts both, and each shard read ahead is logged, so a test sees the read-ahead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from disttrain.core import object_store
from disttrain.core.errors import DataError
from disttrain.data import store_cache

logger = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
FETCH_ATTEMPTS = 3  # an object of a group removed by another process's bound before its read


@dataclass(frozen=True)
class ReaderLimits:
    """The reader's bounds (`training.shard_cache_bytes`, `num_shards_in_memory`,
    `num_shards_ahead`)."""

    cache_bytes: int = 0
    num_in_memory: int = 4
    num_ahead: int = 2


@dataclass
class ReaderStats:
    """What the reader did: shards read by the read-ahead thread, read by a step itself, and
    steps that waited for a read-ahead in flight."""

    read_ahead: int = 0
    read_on_demand: int = 0
    waited: int = 0
    names_read_ahead: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ShardFiles:
    """The shards of one data set: `files` under `location` (a local folder or any fsspec
    URL), each holding the arrays `fields` (none: a shard's arrays are read another way,
    see `ShardContents`)."""

    location: str
    files: tuple[str, ...]
    fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardContents:
    """How a shard's arrays are had when not by reading a .npz (all None: they are).

    Attributes:
        read: a shard's contents by its number, in place of fetching and reading a .npz.
        members: a shard of several objects (a group of images): each one's name under
            the location, all fetched (and bounded on disk) as the shard...
        decode: ...then `decode(their bytes, shard)`.
    """

    read: Callable[[int], Any] | None = None
    members: list[list[str]] | None = None
    decode: Callable[[list[bytes], int], Arrays] | None = None


class ShardReader:
    """The `shards` of one data set, read lazily within `limits`, fetched from a store into
    `data_dir` when `download`. Thread-safe; picklable (a copy starts empty)."""

    def __init__(self, shards: ShardFiles, data_dir: str, download: bool, limits: ReaderLimits,
                 contents: ShardContents = ShardContents()):
        self.location, self.files, self.fields = shards.location, list(shards.files), tuple(shards.fields)
        self.data_dir, self.download, self.limits = data_dir, download, limits
        self.read, self.members, self.decode = contents.read, contents.members, contents.decode
        self._start()

    def _start(self) -> None:
        self._lock = threading.Lock()
        self._memory: OrderedDict[int, Arrays] = OrderedDict()
        self._loading: dict[int, Future] = {}
        self._pinned: set[int] = set()
        self._plan: list[int] = []
        self._wanted: set[int] = set()  # the batch's shards and those read ahead for it: kept in memory
        self._cursor = -1
        self._executor: ThreadPoolExecutor | None = None
        self.stats = ReaderStats()

    def __getstate__(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ("location", "files", "fields", "data_dir", "download",
                                                     "limits", "read", "members", "decode")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    def plan(self, shards: list[int]) -> None:
        """The shards this process will read next, in order (consecutive repeats allowed).
        Logs what the reader did since the last plan (the last epoch's start), and counts
        afresh."""
        with self._lock:
            done, self.stats = self.stats, ReaderStats()
            self._plan = [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]
            self._cursor = -1
        if done.read_ahead or done.read_on_demand:
            logger.info("training.dataset: %d shards read ahead, %d read by the steps themselves (%d steps "
                        "waited for a read ahead) since the last plan", done.read_ahead, done.read_on_demand,
                        done.waited)
        if self._plan:
            self._read_ahead(self._plan[:self.limits.num_ahead + 1])

    def arrays(self, shard: int) -> Arrays:
        """Shard `shard`'s arrays: from memory, from a read-ahead in flight, or read now.

        Raises:
            DataError: the shard is missing, unreadable or not as its index says (and the
                store's errors, as `store_cache.local_copy`'s).
        """
        with self._lock:
            if shard in self._memory:
                self._memory.move_to_end(shard)
                return self._memory[shard]
            pending = self._loading.get(shard)
            if pending is not None:
                self.stats.waited += 1
        if pending is not None:
            return pending.result()
        arrays = self._load(shard)
        with self._lock:
            self.stats.read_on_demand += 1
        return arrays

    def touched(self, shards: list[int]) -> None:
        """A batch is about to read `shards`: move the cursor along the plan and read the next
        ones ahead."""
        if self.limits.num_ahead == 0:
            with self._lock:
                self._wanted = set(shards)
            return
        with self._lock:
            plan, start = self._plan, max(self._cursor, 0)
            found = []
            for shard in shards:
                try:
                    found.append(plan.index(shard, start))
                except ValueError:
                    pass
            if found:
                self._cursor = max(found)
                following = plan[self._cursor + 1:self._cursor + 1 + self.limits.num_ahead]
            else:  # off the plan: the next shards by number
                last = max(shards)
                following = list(range(last + 1, min(last + 1 + self.limits.num_ahead, len(self.files))))
            self._wanted = set(shards) | set(following)
        self._read_ahead(following)

    def _read_ahead(self, shards: list[int]) -> None:
        if self.limits.num_ahead == 0:
            return
        with self._lock:
            wanted = [s for s in shards if s not in self._memory and s not in self._loading]
            if self._executor is None and wanted:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-read-ahead")
            for shard in wanted:
                self._loading[shard] = self._executor.submit(self._ahead, shard)

    def _ahead(self, shard: int) -> Arrays:
        arrays = self._load(shard)
        with self._lock:
            self.stats.read_ahead += 1
            self.stats.names_read_ahead.append(self.files[shard])
        logger.debug("training.dataset: shard %s read ahead", self.files[shard])
        return arrays

    def _load(self, shard: int) -> Arrays:
        """Fetch (on a store) and read shard `shard`, then hold it in memory."""
        with self._lock:
            self._pinned.add(shard)
        try:
            if self.read is not None:
                arrays = self.read(shard)
            else:
                arrays = self._decoded(shard)
        except BaseException:
            with self._lock:
                self._pinned.discard(shard)
                self._loading.pop(shard, None)
            raise
        with self._lock:  # in memory before it leaves `_loading`: no step reads it twice
            self._memory[shard] = arrays
            self._memory.move_to_end(shard)
            spare = [s for s in self._memory if s not in self._wanted]  # least recently used first
            for old in spare[:max(0, len(self._memory) - self.limits.num_in_memory)]:
                del self._memory[old]
            self._pinned.discard(shard)
            self._loading.pop(shard, None)
        return arrays

    def _decoded(self, shard: int) -> Arrays:
        if self.decode is not None:
            return self.decode(self._contents(shard), shard)
        # Its bytes, read as it is fetched: another process's bound may remove the copy then.
        return self._read(io.BytesIO(self._contents(shard)[0]), shard)

    def _contents(self, shard: int) -> list[bytes]:
        """The bytes of each of shard `shard`'s objects, each read as soon as it is fetched:
        another process's disk bound may remove a copy between its fetch and its read, and
        then costs only that object's fetch again (not the whole group's)."""
        if not object_store.is_url(self.location):
            return [path.read_bytes() for path in self._local(shard)]
        contents = []
        for part in self._parts(shard):
            url = str(object_store.join(self.location, part))
            for attempt in range(FETCH_ATTEMPTS):
                try:
                    contents.append(store_cache.local_copy(url, self.data_dir, self.download).read_bytes())
                    break
                except FileNotFoundError:
                    if attempt == FETCH_ATTEMPTS - 1:
                        raise
        self._used(shard)
        return contents

    def _used(self, shard: int) -> None:
        if self.limits.cache_bytes:
            for folder in self._folders(shard):  # its use seen by every process of the run
                with contextlib.suppress(OSError):
                    os.utime(folder, ns=(time.time_ns(), time.time_ns()))
            self._bound_disk(keep=shard)

    def _parts(self, shard: int) -> list[str]:
        return self.members[shard] if self.members is not None else [self.files[shard]]

    def _local(self, shard: int) -> list[Path]:
        """The local paths of shard `shard`'s objects, fetched into the cache on a store."""
        where = [object_store.join(self.location, part) for part in self._parts(shard)]
        if not object_store.is_url(self.location):
            return [Path(w) for w in where]
        copies = [store_cache.local_copy(str(w), self.data_dir, self.download) for w in where]
        self._used(shard)
        return copies

    def _folders(self, shard: int) -> list[Path]:
        return [store_cache.cache_folder(str(object_store.join(self.location, part)), self.data_dir)
                for part in self._parts(shard)]

    def _bound_disk(self, keep: int) -> None:
        """Remove the least recently used copies of this data set's shards until their bytes
        on disk are within `limits.cache_bytes`."""
        sizes, changed = {}, {}
        for shard in range(len(self.files)):
            folders = [folder for folder in self._folders(shard) if folder.is_dir()]
            if folders:
                sizes[shard] = sum(_size(path) for folder in folders for path in folder.iterdir())
                changed[shard] = max(folder.stat().st_mtime for folder in folders)
        total = sum(sizes.values())
        with self._lock:
            busy = self._pinned | {keep}
        # Least recently used first by any process of the run (a use touches the folders):
        # the processes share the cache, and one that removed the copies it had not used
        # itself first took each other's fresh fetches before they were read.
        for shard in sorted(sizes, key=lambda s: changed[s]):
            if total <= self.limits.cache_bytes:
                break
            if shard in busy or shard not in sizes:
                continue
            for folder in self._folders(shard):
                if not folder.is_dir():  # (a shard of several objects: not every one fetched)
                    continue
                for copy in folder.iterdir():  # not the folder: another process may fill it now
                    if not copy.name.startswith("."):  # nor a fetch's temporary file
                        copy.unlink(missing_ok=True)
            total -= sizes.pop(shard)

    def _read(self, source: io.BytesIO, shard: int) -> Arrays:
        try:
            with np.load(source, allow_pickle=False) as data:
                missing = [name for name in self.fields if name not in data.files]
                if missing:
                    raise DataError(f"training.dataset: shard {self.files[shard]} has no array "
                                    f"{missing[0]!r} (it has {sorted(data.files)}); write it with the "
                                    "index's fields")
                return {name: data[name] for name in self.fields}
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"training.dataset: shard {self.files[shard]} is not a readable .npz of plain "
                            f"arrays ({e}); write it again with disttrain.data.shards.write_shards") from e

    def wait(self) -> None:
        """Return once the reads ahead asked for so far are done (their errors are the
        steps' to meet)."""
        with self._lock:
            pending = list(self._loading.values())
        concurrent.futures.wait(pending)

    def close(self) -> None:
        """Stop the read-ahead thread (reads in flight finish)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def _size(path: Path) -> int:
    """The bytes of file `path`; 0 when it is not a file, or no longer there: the run's other
    processes share the cache, and one may remove a copy (its own bound) or rename a fetch
    into place between this process's listing of a folder and its look at the file."""
    try:
        return path.stat().st_size if path.is_file() else 0
    except FileNotFoundError:
        return 0
