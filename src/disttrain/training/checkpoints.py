"""The position of a run and the checkpoint store of a process that writes its own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class Position:
    """Where training stands; saved in every checkpoint.

    `epoch` is the epoch in progress (after an epoch's evaluation it is the next one),
    `train_time_s` the training clock.
    """

    epoch: int = 0
    step: int = 0
    samples_processed: int = 0
    train_time_s: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.step = int(state["step"])
        self.samples_processed = int(state["samples_processed"])
        self.train_time_s = float(state["train_time_s"])


class LocalCheckpoints:
    """Checkpoints of one process in a folder of its own (the baseline, a PS worker).

    Args:
        folder: a local folder, or a store's URL (`s3://bucket/run`; see `core.object_store`).
        keep: how many of the newest checkpoints to keep.
        fits: what a checkpoint must also agree with to be resumed from, beyond being
            intact: given its state, None when it fits, else why not. A checkpoint that
            does not fit is passed over for the newest older one that does, and with none
            left the process starts from the beginning (a parameter-server worker whose
            newest checkpoint is ahead of a shard that came back from an older one: see
            `WorkerParticipant.unapplied`).
    """

    def __init__(self, folder: str | Path, keep: int,
                 fits: Callable[[dict[str, Any]], str | None] | None = None):
        self.folder = folder if object_store.is_url(folder) else Path(folder)
        self.keep = keep
        self.fits = fits
        self._chosen: tuple[Path | str, dict[str, Any]] | None = None

    def choose(self, resume: bool) -> Path | str | None:
        """The checkpoint to resume from: the newest good one (`ckpt.prepare_checkpoint_dir`)
        that fits (`fits`).

        Raises:
            ConfigError: not resuming, and the folder holds an earlier run's checkpoints.
            CheckpointError: resuming, and every checkpoint in the folder is damaged.
        """
        self._chosen = ckpt.open_checkpoint_dir(self.folder, resume)
        if self._chosen is not None and self.fits is not None:
            self._chosen = self._fitting(*self._chosen)
        return None if self._chosen is None else self._chosen[0]

    def _fitting(self, newest: Path | str, state: dict[str, Any]) -> tuple[Path | str, dict[str, Any]] | None:
        """The newest checkpoint from `newest` down that fits; None when none does."""
        assert self.fits is not None
        why = self.fits(state)
        if why is None:
            return newest, state
        logger.warning("checkpoint %s does not fit the run: %s; trying an older one",
                       object_store.basename(newest), why)
        step = ckpt.checkpoint_step(newest)
        for older in reversed(ckpt.list_checkpoints(self.folder)):
            if ckpt.checkpoint_step(older) >= step:
                continue
            try:
                state = ckpt.load_checkpoint(older)
            except CheckpointError as e:
                logger.warning("skipping checkpoint %s: %s", object_store.basename(older), e)
                continue
            why = self.fits(state)
            if why is None:
                return older, state
            logger.warning("checkpoint %s does not fit the run either: %s", object_store.basename(older), why)
        logger.warning("no checkpoint in %s fits the run: this process starts from the beginning (what the "
                       "run already applied is not applied again)", self.folder)
        return None

    def load(self, path: Path | str) -> dict[str, Any]:
        """The state at `path`; the one `choose` already read and verified, if that file.

        Raises:
            CheckpointError: `path` is unreadable, damaged or fails its checksum.
        """
        chosen, self._chosen = self._chosen, None  # hand it over once; don't keep it alive
        if chosen is not None and str(chosen[0]) == str(path):
            return chosen[1]
        return ckpt.load_checkpoint(path)

    def save(self, step: int, state: dict[str, Any]) -> None:
        ckpt.save_checkpoint(self.folder, step, state, keep=self.keep)
