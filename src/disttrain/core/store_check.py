"""What a run checks of its checkpoint store before any process starts.

A store the run cannot use is found here, with one line and exit code 2 (`ConfigError`),
rather than at the first checkpoint, minutes into training: a store that every process of
the run cannot share (`memory://` lives in one process's memory), and one it cannot write
(no such bucket, access refused, no credentials, a read-only or full disk), found by
writing, reading back and removing a small object there. An unknown scheme, or one whose
backend is not installed, is refused earlier still, by the config's own checks.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from disttrain.core import object_store, store_retry
from disttrain.core.atomic_files import write_bytes_atomic
from disttrain.core.errors import CheckpointStoreError, ConfigError

logger = logging.getLogger(__name__)

# The name of the object `check_writable` writes and removes.
PROBE_PREFIX = ".disttrain-write-check-"


def process_local(location: str | Path) -> bool:
    """Whether `location` lives in this process's memory (`memory://`): another process, or
    this one once it has ended, never sees it."""
    return object_store.is_url(location) and str(location).split("://", 1)[0].lower() == "memory"


def check_checkpoint_dir(folder: str | Path, strategy: str, in_this_process: bool) -> None:
    """Refuse a checkpoint folder the run cannot use; call before starting any process.

    Args:
        folder: `system.checkpoint_dir`, a path or a store's URL.
        strategy: the command, named in the message (`ps`, `ddp`).
        in_this_process: the run trains in the calling process (the baseline); False: in
            processes it starts (and restarts), which `memory://` cannot reach.

    Raises:
        ConfigError: `folder` is in one process's memory and the run trains in others, or
            it cannot be written (see `check_writable`).
    """
    if process_local(folder):
        if not in_this_process:
            raise ConfigError(f"system.checkpoint_dir: {str(folder)!r} lives in one process's memory, and a "
                              f"{strategy} run trains in processes of its own (restarted ones too) that "
                              "cannot see it; use a local folder, file:// or a store every process reaches "
                              "(s3://...)")
        logger.warning("checkpoints in %s last as long as this process: a later --resume finds none there",
                       folder)
    check_writable(folder)


def check_writable(folder: str | Path) -> None:
    """Write, read back and remove a small object in `folder` (made when missing). A store
    error that may clear by itself (a refused connection, a timeout) is retried through the
    retry window first; the others (no such bucket, access refused, no credentials, a
    read-only or full disk) are final at once.

    Raises:
        ConfigError: `folder` cannot be written or read, naming it, the error and what to check.
    """
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    data = name.encode("ascii")

    def probe() -> None:
        if object_store.is_url(folder):
            store = object_store.StoreFolder(str(folder))
            store.write_once(name, lambda handle: handle.write(data))
            try:
                read = store.read_once(name)
            finally:
                store.remove_once(name)
        else:
            path = _write_probe(Path(folder) / name, data)
            try:
                read = path.read_bytes()
            finally:
                path.unlink(missing_ok=True)
        if read != data:
            raise OSError(f"{name} read back other bytes than were written")

    made = _missing_folders(folder)
    try:
        store_retry.retried(probe, folder, "writing a test object",
                            retry_if=lambda e: store_retry.is_store_error(e) and store_retry.is_transient(e))
    except (OSError, CheckpointStoreError) as e:
        error = e.__cause__ if isinstance(e, CheckpointStoreError) and e.__cause__ is not None else e
        raise ConfigError(f"system.checkpoint_dir: cannot write checkpoints to {folder} "
                          f"({store_retry.describe(error)}); check the bucket or folder name, that it is "
                          "writable with the credentials given and has space, or choose another "
                          "--checkpoint-dir") from e
    finally:
        for path in made:  # the check leaves nothing behind: a run refused later writes nothing
            try:
                path.rmdir()
            except OSError:
                break  # not empty (written meanwhile), or not ours to remove


# Hosts that share a checkpoint folder check it at once; each removes the folders it made
# (see `check_writable`), which may be the very folder another is writing its probe into.
PROBE_ATTEMPTS = 3


def _write_probe(path: Path, data: bytes) -> Path:
    """Write the probe at `path`, its folder made again should another host's check have
    removed it between this one making it and writing into it."""
    for _ in range(PROBE_ATTEMPTS - 1):
        try:
            return write_bytes_atomic(path, data, mode=0o600)
        except FileNotFoundError:
            logger.debug("the folder of %s went away while it was being written: making it again", path)
    return write_bytes_atomic(path, data, mode=0o600)


def _missing_folders(folder: str | Path) -> list[Path]:
    """The folders of a local (or file://) `folder` that do not exist yet, deepest first."""
    text = str(folder)
    if object_store.is_url(folder) and not text.startswith("file://"):
        return []
    path = Path(text.removeprefix("file://"))
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing
