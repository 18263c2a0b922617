"""Files that hold a secret (the run's token, a TLS private key), read only when they are
their reader's own: owned by the user reading them (or root, as a mounted secret is) and
open to nobody else (no group or other permission bits), as OpenSSH asks of a private key.
`private_problem` is the rule; `read_private` reads a file by it, checking the file it
opened, so a file swapped in between cannot pass."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from disttrain.core.errors import ConfigError

ROOT_UID = 0


def private_problem(mode: int, owner_uid: int, reader_uid: int) -> str | None:
    """What keeps a file of `mode`, owned by `owner_uid`, from being `reader_uid`'s own
    secret (a sentence ending in the fix, `chmod 600`, for the path to follow), or None
    when nothing does."""
    if owner_uid not in (reader_uid, ROOT_UID):
        return (f"it belongs to user {owner_uid}, not to the user reading it ({reader_uid}): another "
                f"user could change it or read it; keep your own copy, with chmod 600")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"other users may read it (mode {stat.filemode(mode)}); make it private with chmod 600"
    return None


def read_private(path: str | Path, flag: str) -> bytes:
    """The bytes of secret file `path`, given with `flag` (named in errors).

    Raises:
        ConfigError: the file cannot be read, or is not private to its reader (one line
            naming the flag, the file and the fix).
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            status = os.fstat(handle.fileno())
            problem = private_problem(status.st_mode, status.st_uid, os.geteuid())
            data = b"" if problem else handle.read()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from e
    if problem:
        raise ConfigError(f"{flag} {path}: {problem} {path}")
    return data
