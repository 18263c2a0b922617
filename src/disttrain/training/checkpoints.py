"""The position of a run and the checkpoint store of a process that writes its own."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store


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
    """

    def __init__(self, folder: str | Path, keep: int):
        self.folder = folder if object_store.is_url(folder) else Path(folder)
        self.keep = keep
        self._chosen: tuple[Path | str, dict[str, Any]] | None = None

    def choose(self, resume: bool) -> Path | str | None:
        """The checkpoint to resume from: the newest good one (`ckpt.prepare_checkpoint_dir`).

        Raises:
            ConfigError: not resuming, and the folder holds an earlier run's checkpoints.
            CheckpointError: resuming, and every checkpoint in the folder is damaged.
        """
        self._chosen = ckpt.open_checkpoint_dir(self.folder, resume)
        return None if self._chosen is None else self._chosen[0]

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
