"""Atomic save and safe load of full training state.

A checkpoint is one `torch.save` file holding plain containers and tensors: model and
optimizer state, epoch, step, sampler position, RNG states and the resolved config. It is
written to a temporary file in the same folder, flushed, fsynced and renamed over the
final name, so a crash mid-write never leaves a partial file under a checkpoint's name
and never replaces a good one. Loading uses `weights_only=True`: no code runs on load.
"""

from __future__ import annotations

import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disttrain.core.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint_step(\d+)\.pt$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_step{step:08d}.pt"


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
    """Write `obj` with `torch.save` to `path` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in `folder`, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: str | Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_checkpoint(folder: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Save `state` as the checkpoint of `step` and prune all but the newest `keep`.

    Returns:
        The path written.
    """
    path = atomic_torch_save(state, Path(folder) / checkpoint_name(step))
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    logger.debug("saved checkpoint %s", path)
    return path


def prepare_checkpoint_dir(folder: str | Path, resume: bool) -> Path | None:
    """Decide where a run starts: the newest checkpoint when resuming, else nothing.

    A fresh run refuses a folder that already holds checkpoints, so it never overwrites
    or prunes an earlier run's good checkpoints.

    Raises:
        ConfigError: not resuming, and `folder` already holds checkpoints.
    """
    found = list_checkpoints(folder)
    if resume:
        if not found:
            logger.info("--resume: no checkpoint in %s yet, starting from the beginning", folder)
            return None
        return found[-1]
    if found:
        raise ConfigError(f"system.checkpoint_dir: {str(folder)!r} already holds checkpoints "
                          f"(newest {found[-1].name}); pass --resume to continue that run, or "
                          "choose another --checkpoint-dir")
    return None


def save_final_model(path: str | Path, model_state: dict[str, Any], config: Any) -> Path:
    """Write the trained model (and the config that made it) for later evaluation."""
    return atomic_torch_save({"model": model_state, "config": config.to_dict()}, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True`.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt or not a checkpoint.
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} does not exist") from e
    except Exception as e:  # torch raises several types for truncated or foreign files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({reason[:200]}); delete "
                              "it to resume from the previous one") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a training state dict")
    return state


def require_keys(state: dict[str, Any], keys: tuple[str, ...], path: str | Path) -> None:
    """Raises CheckpointError naming the first of `keys` missing from `state`."""
    for key in keys:
        if key not in state:
            raise CheckpointError(f"checkpoint {path} lacks {key!r}; it was not written by this "
                                  "strategy or is from an incompatible version")


def load_strategy_checkpoint(path: str | Path, strategy: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """Load a training checkpoint written by `strategy` holding `keys`.

    Raises:
        CheckpointError: unreadable, a key missing, or written by another strategy.
    """
    state = load_checkpoint(path)
    require_keys(state, ("strategy",), path)
    if state["strategy"] != strategy:
        raise CheckpointError(f"checkpoint {path} was written by strategy {state['strategy']!r}, "
                              f"not {strategy!r}; use another --checkpoint-dir")
    require_keys(state, keys, path)
    return state


def checkpoint_step(path: str | Path) -> int:
    """The step in a checkpoint's file name (-1 when the name is not a checkpoint's)."""
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    return int(match.group(1)) if match else -1


def rng_state() -> dict[str, Any]:
    """Every RNG's state, as types `weights_only` loading accepts."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` captured."""
    random.setstate(_as_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["key"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value
