"""Each rank's own credentials in restart mode: torch's elastic agent hands every rank the
environment it was given, so the run's secret must not be in it. The launcher (the
operator's process, which holds the secret) writes one node token per rank of the run
(`rank<R>`, role rank: `core.identity`) into a folder only its user can read, and hands
the ranks that folder's path (`RANK_TOKENS_ENV`), never a token; each rank reads its own
file, by the rank the agent gave it (which may change between restarts).
"""

from __future__ import annotations

from pathlib import Path

from disttrain.core.auth import read_token_file, write_token_file
from disttrain.core.identity import node_token

RANK_TOKENS_ENV = "DISTTRAIN_RANK_TOKENS"
ROLE = "rank"


def token_file(folder: Path, rank: int) -> Path:
    """Where rank `rank`'s node token is in `folder`."""
    return folder / f"rank{rank}.token"


def write_rank_tokens(folder: Path, secret: str, world_size: int) -> Path:
    """Write the node token of every rank of a run of `world_size` ranks, made from
    `secret`, into the new folder `folder` (mode 700; each file 600). Returns `folder`.

    Raises:
        ConfigError: the folder or a file cannot be written, or is there already.
    """
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)  # whatever the umask
    for rank in range(world_size):
        write_token_file(token_file(folder, rank), node_token(secret, f"rank{rank}", ROLE))
    return folder


def read_rank_token(folder: str | Path, rank: int) -> str:
    """Rank `rank`'s own node token, from the launcher's `folder`.

    Raises:
        ConfigError: the file cannot be read, or is not private to its reader.
    """
    return read_token_file(token_file(Path(folder), rank))
