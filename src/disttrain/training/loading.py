"""Data loading in worker processes (`training.loader_workers`): a data set's training
batches loaded ahead, in the order the training loop will ask for them, by torch's
DataLoader workers (batches in pinned memory when the run computes on CUDA).

The sampler stays the one source of order and position. At each epoch start the loop
hands over the epoch's remaining batches, read from a copy of the sampler (so its
position, which checkpoints record, never runs ahead of the steps taken); the workers
load them in that order. A participant asks for a batch by its indices as before
(`batch(indices)`): the next prefetched batch is returned when its indices are the ones
asked for, and otherwise (a balance re-plan changed the batches, a redone block) the
batch is loaded here and the read-ahead starts again after it. Either way a batch holds
exactly what `dataset.batch(indices)` returns, so a run, and a resumed run, train on the
same tensors with or without workers.

The workers are started once per run (spawned: a process forked from one that holds
gRPC or gloo threads may deadlock), and each gets the data set once; they load only,
the model and the optimizer stay in the training process.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Sampler

from disttrain.data.plugins import import_plugin_file, imported_plugin_files

logger = logging.getLogger(__name__)


def prefetch(source: BatchSource, num_workers: int, device_type: str = "cpu") -> PrefetchedBatches | None:
    """`source`'s batches loaded by `num_workers` worker processes (`training.loader_workers`),
    pinned when the run computes on CUDA; None when 0 (loaded in the training process)."""
    if num_workers == 0:
        return None
    return PrefetchedBatches(source, num_workers, pin_memory=device_type == "cuda")


class BatchSource(Protocol):
    """What the training loop draws batches from (e.g. `data.ArrayDataset`)."""

    def batch(self, indices: torch.Tensor) -> Any: ...

    def __len__(self) -> int: ...


class _Batches(torch.utils.data.Dataset):
    """A data set whose items are whole batches, keyed by their indices (what a worker loads)."""

    def __init__(self, source: BatchSource):
        self.source = source

    def __getitem__(self, indices: torch.Tensor) -> Any:
        return self.source.batch(indices)

    def __reduce__(self) -> tuple:
        """A spawned worker cannot import a user's data set file by its module name (the
        file was imported by path, `data.plugins`), so when such files are loaded the
        worker imports them again by path before it unpickles the source."""
        files = imported_plugin_files()
        if not files:
            return (_Batches, (self.source,))
        return (_rebuild, (files, pickle.dumps(self.source)))


def _rebuild(files: list[tuple[str, str]], source: bytes) -> _Batches:
    for name, path in files:
        import_plugin_file(name, path)
    return _Batches(pickle.loads(source))


class _Plan(Sampler):
    """The batches the loop will ask for next, as DataLoader's sampler: set before each pass."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class PrefetchedBatches:
    """`source.batch(indices)`, served from worker processes that load ahead.

    Args:
        source: the training set (its `batch(indices)` is what the workers call).
        num_workers: loader processes (> 0).
        pin_memory: return batches in pinned memory (for copies to CUDA that overlap).
        prefetch_factor: batches each worker loads ahead.
    """

    def __init__(self, source: BatchSource, num_workers: int, pin_memory: bool = False,
                 prefetch_factor: int = 2):
        if num_workers < 1:
            raise ValueError(f"training.loader_workers: {num_workers} workers; use PrefetchedBatches "
                             "with at least one (0 loads in the training process)")
        self.source = source
        self._plan = _Plan()
        self._loader: DataLoader | None = DataLoader(
            _Batches(source), sampler=self._plan, batch_size=None, num_workers=num_workers,
            pin_memory=pin_memory, persistent_workers=True, prefetch_factor=prefetch_factor,
            multiprocessing_context="spawn",
            # Its own generator: the workers' seeds drawn from torch's global one would shift
            # every later dropout mask, and differently in a resumed run.
            generator=torch.Generator().manual_seed(0))
        self._iterator: Iterator[Any] | None = None
        self._expected: deque[torch.Tensor] = deque()
        self._upcoming: Callable[[], list[torch.Tensor]] = list
        self.num_prefetched = 0  # batches served by the workers
        self.num_direct = 0  # batches loaded here (off the plan)

    def __len__(self) -> int:
        return len(self.source)

    def start_epoch(self, upcoming: Callable[[], list[torch.Tensor]]) -> None:
        """Load ahead the batches `upcoming()` returns: every batch the loop will ask for
        from now on in this epoch, in order, read without moving the sampler. Called at
        each epoch start, and again whenever a batch off the plan was asked for."""
        self._upcoming = upcoming
        self._replan()

    def _replan(self) -> None:
        if self._loader is None:
            raise RuntimeError("the loader is closed")
        batches = self._upcoming()
        self._plan.batches = batches
        self._expected = deque(batches)
        self._iterator = iter(self._loader) if batches else None

    def batch(self, indices: torch.Tensor) -> Any:
        """The batch of `indices`, as `source.batch(indices)` returns it."""
        if self._expected and torch.equal(self._expected[0], indices):
            self._expected.popleft()
            self.num_prefetched += 1
            assert self._iterator is not None  # a plan with batches has its iterator
            return next(self._iterator)
        self.num_direct += 1
        loaded = self.source.batch(indices)
        if self._expected:  # the loop left the plan (a re-plan): read ahead from here again
            logger.debug("batch off the loader's plan; loading ahead again from the next one")
            self._replan()
        return loaded

    def close(self) -> None:
        """Stop the worker processes (they also end with this process)."""
        if self._loader is not None:
            logger.info("loader workers: %d batches loaded ahead, %d in the training process",
                        self.num_prefetched, self.num_direct)
        self._iterator = None
        self._expected.clear()
        self._loader = None  # the persistent iterator shuts its workers down when collected
