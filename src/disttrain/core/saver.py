"""Checkpoints written in the background, with bounded memory and errors that surface.

Training hands a snapshot of its state to `CheckpointWriter.submit` and goes on while one
daemon thread writes it with `checkpoint.save_checkpoint`. The writer is bounded on
purpose: at most one write is in flight and at most one snapshot waits behind it. A newer
snapshot replaces the waiting one (the latest wins; a checkpoint that would be out of date
before it reached the disk is worth nothing), so however far training runs ahead of a
slow disk, memory holds at most two copies of the state and the queue never grows.

A store that fails is retried within the write (`store_retry`): training goes on meanwhile,
and a snapshot that waits is replaced by newer ones as usual. A write that fails for good
(`CheckpointStoreError` past the retry window, or `CheckpointError` for a state that cannot
be saved) is logged at ERROR at once, in one line, and raised by the next `submit`,
`flush` or `close`: a run never believes it has a checkpoint it does not have. An owner
that waits on no call of its own (a parameter-server shard, which saves from its RPC
handlers) passes `on_failure` instead: the error is handed to it once, from the writer's
thread, and later snapshots are dropped (the process is stopping).
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import CheckpointError, CheckpointStoreError, DisttrainError

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """Write checkpoints of one folder in a background thread, latest first.

    Call `submit` after each snapshot, `flush` where the run needs its checkpoint on disk
    (before reporting it, before exiting) and `close` once at the end. If the process dies
    without `close`, a write in flight is cut short: it leaves only a temporary file, which
    `checkpoint.prepare_checkpoint_dir` removes at the next start.

    Args:
        folder: where checkpoints go (`checkpoint_stepNNNNNNNN.pt` and its `.sha256`): a
            local folder or a store's URL (`s3://bucket/run`; see `core.object_store`).
        keep: how many of the newest checkpoints each write leaves in `folder`.
        on_failure: called once, from the writer's thread, with the error of a write that
            failed for good; `submit`, `flush` and `close` then raise nothing, and later
            snapshots are dropped. None: they raise it.

    Raises:
        ValueError: `keep` is below 1.
    """

    def __init__(self, folder: str | Path, keep: int,
                 on_failure: Callable[[DisttrainError], None] | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (got {keep}): the newest checkpoint is the one "
                             "a resume needs")
        self.folder = folder if object_store.is_url(folder) else Path(folder)
        self.keep = keep
        self._changed = threading.Condition()
        self._waiting: tuple[int, dict[str, Any]] | None = None
        self._writing_step: int | None = None
        self._error: DisttrainError | None = None
        self._on_failure = on_failure
        self._failed = False  # handed to on_failure: nothing more is written
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, step: int, state: dict[str, Any]) -> None:
        """Queue `state` as the checkpoint of `step`; returns at once.

        `state` must not change afterwards (pass copies of live tensors). It replaces a
        snapshot still waiting, which is then never written.

        Raises:
            CheckpointError, CheckpointStoreError: an earlier write failed (then `state` is
                not queued).
            RuntimeError: called after `close`.
        """
        with self._changed:
            self._raise_error()
            if self._closed:
                raise RuntimeError(f"CheckpointWriter for {self.folder} is closed; submit before close()")
            if self._failed:
                logger.info("checkpoint of step %d not written: the store failed (reported)", step)
                return
            if self._waiting is not None:
                logger.info("checkpoint of step %d replaced by step %d before it was written",
                            self._waiting[0], step)
            self._waiting = (step, state)
            self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until everything submitted is written (or replaced).

        Raises:
            CheckpointError, CheckpointStoreError: a write failed since the last error was
                raised (the first such error, naming the file and the reason), or
                `timeout_s` passed first.
        """
        with self._changed:
            if not self._changed.wait_for(self._idle, timeout_s):
                raise CheckpointError(f"checkpoint writes into {self.folder} did not finish within "
                                      f"{timeout_s}s; check that its disk is not stalled or full")
            self._raise_error()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, then stop the thread. Calling it again does nothing more.

        Raises:
            CheckpointError: as `flush`.
        """
        try:
            self.flush(timeout_s)
        finally:
            with self._changed:
                self._closed = True
                self._changed.notify_all()
            self._thread.join(timeout_s)

    def _idle(self) -> bool:
        return self._waiting is None and self._writing_step is None

    def _raise_error(self) -> None:
        """Raise the pending error once (lock held): it is the caller's from then on."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return
                step, state = self._waiting
                self._waiting = None
                self._writing_step = step
            error = self._write(step, state)
            del state  # the snapshot is freed before the thread waits for the next
            with self._changed:
                self._writing_step = None
                hand_over = self._record(error)
                self._changed.notify_all()
            if hand_over is not None:  # outside the lock: the owner may stop what calls submit
                self._on_failure(hand_over)

    def _write(self, step: int, state: dict[str, Any]) -> DisttrainError | None:
        """Write one checkpoint; returns what went wrong, or None."""
        path = object_store.join(self.folder, ckpt.checkpoint_name(step))
        try:
            ckpt.save_checkpoint(self.folder, step, state, keep=self.keep)
        except CheckpointStoreError as e:  # its one line says it all: the store, the error, --resume
            return e
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            error = CheckpointError(f"could not write checkpoint {path} ({reason[:200]}); check that "
                                    f"{self.folder} is writable and its disk has space")
            error.__cause__ = e
            return error
        return None

    def _record(self, error: DisttrainError | None) -> DisttrainError | None:
        """Log a failed write at once (its traceback only with -v); keep the first unraised
        one for the caller, or return it when it is `on_failure`'s, the first time (lock held)."""
        if error is None:
            return None
        logger.error("%s", error, exc_info=error.__cause__ if logger.isEnabledFor(logging.DEBUG) else None)
        if error.__cause__ is not None:  # its frames hold the snapshot: free it, keep the lines
            traceback.clear_frames(error.__cause__.__traceback__)
        if self._on_failure is not None:
            first, self._failed = not self._failed, True
            self._waiting = None  # the store failed for good: the next write would only fail again
            return error if first else None
        if self._error is None:
            self._error = error
        return None
