"""Atomic save, checked load and resume-point choice for full training state.

A checkpoint is one `torch.save` file holding plain containers and tensors: model and
optimizer state, epoch, step, sampler position, RNG states and the resolved config. It is
written to a temporary file in the same folder (`.NAME.XXXX.tmp`), flushed, fsynced and
renamed over the final name, so a crash mid-write never leaves a partial file under a
checkpoint's name and never replaces a good one. Beside it, `NAME.sha256` holds its
SHA-256 (see `atomic_files`), which loading verifies before `torch.load(weights_only=True)`
reads the file: no code runs on load, and a damaged file is named as such. Resuming takes
the newest checkpoint that passes both and warns about each newer one it skips.

Every write, listing and store read is retried with back-off while the store fails, and
past the process's retry window stops the run with one line (`store_retry`).

A folder may also be a store's URL (`s3://bucket/run`, any fsspec URL; see `object_store`):
there a checkpoint is complete only once its sidecar is up and matches, so listing,
"latest", pruning and resuming see complete checkpoints only. A plain path keeps the
local code.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disttrain.core import object_store, store_retry
from disttrain.core.atomic_files import SIDECAR_SUFFIX, atomic_torch_save, sidecar_path, verify_sha256
from disttrain.core.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint_step(\d+)\.pt$")
# The temporary files `atomic_torch_save` creates (`.NAME.XXXX.tmp`), and nothing else.
TEMPORARY_PATTERN = re.compile(r"^\..+\.tmp$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_step{step:08d}.pt"


def list_checkpoints(folder: str | Path) -> list[Any]:
    """Checkpoint files in `folder`, oldest step first (on a store: the complete ones, as URLs).

    Raises:
        CheckpointStoreError: the folder could not be listed through the retry window.
    """
    if object_store.is_url(folder):
        found = [object_store.join(folder, name) for name in _store_checkpoints(str(folder))[0]]
    else:
        found = store_retry.retried(lambda: _local_checkpoints(Path(folder)), folder, "listing the folder")
    store_retry.remember(folder, [checkpoint_step(path) for path in found])
    return found


def _local_checkpoints(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def _store_checkpoints(folder: str) -> tuple[list[str], list[str]]:
    """Names of the complete checkpoints in a store's folder (oldest step first), and of the
    checkpoint objects there without a sidecar (uploads that never finished)."""
    present = set(object_store.StoreFolder(folder).names())
    found = sorted((int(m.group(1)), name) for name in present if (m := CHECKPOINT_PATTERN.match(name)))
    complete = [name for _, name in found if name + SIDECAR_SUFFIX in present]
    incomplete = [name for _, name in found if name + SIDECAR_SUFFIX not in present]
    return complete, incomplete


def latest_checkpoint(folder: str | Path) -> Any:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_checkpoint(folder: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Save `state` as the checkpoint of `step` and prune all but the newest `keep`; the
    folder is made as needed. A store that fails is retried (see the module's docstring).

    Returns:
        The path written.

    Raises:
        CheckpointStoreError: the store failed through the retry window; the checkpoints
            already complete there are untouched.
        Whatever `torch.save` raises for a state it cannot save, at once.
    """
    name = checkpoint_name(step)
    if object_store.is_url(folder):
        store_retry.incomplete(folder, step)  # overwriting it removes its sum first
        path = object_store.save(state, str(object_store.join(folder, name)))
        store_retry.completed(folder, step)
        store = object_store.StoreFolder(str(folder))
        for old in _store_checkpoints(str(folder))[0][:-keep]:
            store_retry.incomplete(folder, checkpoint_step(old))
            store.remove(old + SIDECAR_SUFFIX)  # the sum first: without it the object is no checkpoint
            store.remove(old)
        logger.debug("saved checkpoint %s", path)
        return path
    path = store_retry.retried(lambda: atomic_torch_save(state, Path(folder) / name), folder,
                               f"writing {name}")
    store_retry.completed(folder, step)

    def prune() -> None:
        for old in _local_checkpoints(Path(folder))[:-keep]:
            store_retry.incomplete(folder, checkpoint_step(old))
            old.unlink(missing_ok=True)  # the file first: a checkpoint never stands without its sum
            sidecar_path(old).unlink(missing_ok=True)

    store_retry.retried(prune, folder, "removing older checkpoints")
    logger.debug("saved checkpoint %s", path)
    return path


def prepare_checkpoint_dir(folder: str | Path, resume: bool) -> Path | str | None:
    """Decide where a run starts: the newest good checkpoint when resuming, else nothing.

    Call once, before the run's first save into `folder`: it removes the temporary files
    an interrupted save left there. When resuming it loads candidates newest first
    (see `load_latest_good_checkpoint`), so a caller that loads the returned path reads a
    file already verified. A fresh run refuses a folder that already holds checkpoints,
    so it never overwrites or prunes an earlier run's good checkpoints.

    Raises:
        ConfigError: not resuming, and `folder` already holds checkpoints.
        CheckpointError: resuming, and every checkpoint in `folder` is damaged.
    """
    chosen = open_checkpoint_dir(folder, resume)
    return None if chosen is None else chosen[0]


def open_checkpoint_dir(folder: str | Path, resume: bool) -> tuple[Path | str, dict[str, Any]] | None:
    """`prepare_checkpoint_dir`, returning the chosen checkpoint's state as well, so the
    caller does not read it a second time.

    Raises:
        ConfigError, CheckpointError: as `prepare_checkpoint_dir`.
    """
    found = list_checkpoints(folder)
    if found and not resume:  # refused before anything in `folder` changes
        raise ConfigError(f"system.checkpoint_dir: {str(folder)!r} already holds checkpoints "
                          f"(newest {object_store.basename(found[-1])}); pass --resume to continue that "
                          "run, or choose another --checkpoint-dir")
    clean_temporary_files(folder)
    if not resume:
        return None
    chosen = load_latest_good_checkpoint(folder)
    if chosen is None:
        logger.info("--resume: no checkpoint in %s yet, starting from the beginning", folder)
    return chosen


def load_latest_good_checkpoint(folder: str | Path) -> tuple[Path | str, dict[str, Any]] | None:
    """Load the newest checkpoint in `folder` that is intact, trying newest first.

    A checkpoint that is truncated, corrupt, fails its checksum or cannot be read is
    skipped with a WARNING naming it and the reason; it is left on disk for inspection.

    Returns:
        (path, state) of the first good one; None when `folder` holds no checkpoint.

    Raises:
        CheckpointError: `folder` holds checkpoints and none of them is good.
    """
    found = list_checkpoints(folder)
    for path in reversed(found):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s, trying an older one: %s", object_store.basename(path), e)
    if not found:
        return None
    names = ", ".join(object_store.basename(p) for p in found)
    raise CheckpointError(f"no usable checkpoint in {folder}: {names} are "
                          "all truncated, corrupt or fail their checksum (reasons logged above); "
                          "restore a good copy, or move them away to start the run over")


def clean_temporary_files(folder: str | Path) -> list[Any]:
    """Remove the temporary files (`.NAME.XXXX.tmp`) that interrupted saves left in `folder`.

    Only plain files whose names match that pattern are removed, nothing else. Call only
    while no process is saving into `folder`: a save in flight owns such a file.

    On a store, the same for checkpoint objects without a sidecar: uploads that never
    finished (no reader takes them; removing them keeps a later save's listing clean).

    Returns:
        The files removed.
    """
    if object_store.is_url(folder):
        store = object_store.StoreFolder(str(folder))
        incomplete = _store_checkpoints(str(folder))[1]
        for name in incomplete:
            store.remove(name)
        if incomplete:
            logger.info("removed %d checkpoint(s) whose upload never finished from %s: %s",
                        len(incomplete), folder, ", ".join(incomplete))
        removed = [object_store.join(folder, name) for name in incomplete]
        if store.local_root is None:
            return removed
        return removed + clean_temporary_files(store.local_root)  # a file:// folder's are files
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = [p for p in sorted(folder.iterdir())
               if TEMPORARY_PATTERN.match(p.name) and p.is_file() and not p.is_symlink()]
    for path in removed:
        path.unlink(missing_ok=True)
    if removed:
        logger.info("removed %d temporary file(s) left by an interrupted save in %s: %s", len(removed),
                    folder, ", ".join(p.name for p in removed))
    return removed


def save_final_model(path: str | Path, model_state: dict[str, Any], config: Any) -> Any:
    """Write the trained model (and the config that made it) for later evaluation.

    Raises:
        CheckpointStoreError: the store failed through the retry window.
    """
    state = {"model": model_state, "config": config.to_dict()}
    if object_store.is_url(path):
        return object_store.save(state, str(path))
    path = Path(path)
    return store_retry.retried(lambda: atomic_torch_save(state, path), path.parent,
                               f"writing {path.name}")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify a checkpoint's checksum, then load it with `weights_only=True`.

    Its `.sha256` sidecar is required, on a local disk as on a store.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt, fails its checksum or is
            not a checkpoint.
    """
    if object_store.is_url(path):
        source: Any = object_store.load_buffer(str(path))
    else:
        path = source = Path(path)
        verify_sha256(path)
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
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


def checkpoint_step(path: str | Path) -> int:
    """The step in a checkpoint's file name (-1 when the name is not a checkpoint's)."""
    match = CHECKPOINT_PATTERN.match(object_store.basename(path))
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
