"""A live run's checkpoints: what survives the loss of every rank at once (the launcher
killed, the machine lost), where live recovery itself cannot help.

Every member of a generation holds the same state after each step (model, optimizer,
position, ledger; see `trainer`), so the group's leader alone writes it, every
`training.checkpoint_interval` steps, in the background (`core.saver.CheckpointWriter`:
the step after the snapshot does not wait for the disk or the store). The folder may be
a store's URL, as in restart mode. A run started with `--resume` gives its first
generation's leader the newest good checkpoint; the others take it from that leader
the way a joiner takes a live peer's state, so a whole-run crash loses at most the
steps since the last checkpoint, and the ledger carried in it keeps `samples_lost` at 0.
A generation started by restarted ranks after every member died while the launcher
lived (`restart`) reads it the same way.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from disttrain.core import checkpoint as ckpt
from disttrain.core.saver import CheckpointWriter
from disttrain.strategies.ddp.live.state import flatten, unflatten
from disttrain.strategies.ddp.live.trainer import Progress

logger = logging.getLogger(__name__)

LIVE_KEYS = ("model", "progress", "ledger")
PROGRESS_KEYS = tuple(f.name for f in fields(Progress))  # every piece of the position


class LiveCheckpoints:
    """The checkpoints one live rank writes while it leads a generation.

    Args:
        folder: `system.checkpoint_dir` (a path or a store's URL).
        interval: steps between checkpoints.
        keep: how many of the newest checkpoints stay.
    """

    def __init__(self, folder: str | Path, interval: int, keep: int):
        self.folder, self.interval, self.keep = folder, interval, keep
        self._writer: CheckpointWriter | None = None
        self._queued: int | None = None  # the step of the newest checkpoint this rank queued

    def due(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Queue a copy of `state` as the checkpoint of `step` (returns at once).

        Raises:
            CheckpointError: an earlier write failed.
        """
        if self._writer is None:
            self._writer = CheckpointWriter(self.folder, self.keep)
        self._writer.submit(step, snapshot(state))
        self._queued = step

    def save_final(self, step: int, state: dict[str, Any]) -> None:
        """The run's last step: queue its checkpoint unless this rank already did. A leader
        that took over near the end writes it too, so the newest checkpoint of a finished
        run holds the whole run (its ledger complete; `--resume` finds nothing left to do),
        even when the leader before it died in the middle of writing it."""
        if self._queued != step:
            self.save(step, state)

    def close(self) -> None:
        """Wait for the write in flight (the run's last checkpoint is then complete).

        Raises:
            CheckpointError: a write failed.
        """
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of `state` that training can no longer change (fresh tensors)."""
    return unflatten(*flatten(state))


def load_resume_state(folder: str | Path, why: str = "--resume") -> dict[str, Any] | None:
    """The newest good checkpoint of `folder`, checked to be a live run's; None when there
    is none yet (the run starts from the beginning). `why` names who reads it, in the log.

    Raises:
        CheckpointError: every checkpoint is damaged, or the newest good one was not
            written by a live run.
    """
    chosen = ckpt.open_checkpoint_dir(folder, resume=True)
    if chosen is None:
        return None
    path, state = chosen
    ckpt.require_keys(state, LIVE_KEYS, path)
    ckpt.require_keys(state["progress"], PROGRESS_KEYS, path)
    logger.info("%s: taking the run's state from %s (step %d)", why, path, int(state["progress"]["step"]))
    return state
