"""Logging set-up, done once at each process's entry point with its role and rank."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from disttrain.core.refusal_log import printable

FORMAT = "%(asctime)s %(levelname)s [{role}{rank}] %(message)s"
# With debug logging, each line also names the module that wrote it.
DEBUG_FORMAT = "%(asctime)s %(levelname)s [{role}{rank}] %(name)s: %(message)s"


class EscapingFormatter(logging.Formatter):
    """A formatter whose lines are one line each: the message (which may hold what a caller
    sent: a node id, a host name, a reason) with its non-printable characters escaped
    (`printable`), so a newline or a terminal's control sequence in it cannot forge a
    line; a traceback, appended after, keeps its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)


def setup_logging(role: str, rank: int | None = None, level: int | str = logging.INFO,
                  log_file: str | Path | None = None) -> None:
    """Configure the root logger: stderr, plus `log_file` when given.

    Args:
        role: the process's role (`baseline`, `server`, `worker`, `rank`, `launcher`, ...).
        rank: its rank or index, shown after the role when not None.
    """
    template = DEBUG_FORMAT if level in (logging.DEBUG, "DEBUG") else FORMAT
    fmt = template.format(role=role, rank="" if rank is None else f" {rank}")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        open_log(log_file).close()  # created private, before logging opens it
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(EscapingFormatter(fmt, datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=handlers, force=True)
    for noisy in ("urllib3", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def open_log(path: str | Path):
    """`path` opened for appending bytes, unbuffered; created readable by its owner only
    (a log names hosts, nodes and what they were refused), whatever the umask allows."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab", buffering=0)
