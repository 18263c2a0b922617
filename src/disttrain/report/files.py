"""Reading the JSON a report is built from, and writing what it produces atomically.

Every reading error names the file and says what is wrong in one line (`InputFileError`,
exit code 2); a file written here appears whole under its final name or not at all
(temporary file beside it, fsync, rename).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disttrain.core.atomic_files import write_bytes_atomic
from disttrain.core.errors import InputFileError


def read_json_file(path: str | Path, what: str = "file") -> Any:
    """The parsed content of the JSON file at `path`.

    Args:
        what: what the file should be, for the message ("run summary", "artifact").

    Raises:
        InputFileError: the file is missing, a folder, unreadable or not JSON.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise InputFileError(f"{path}: does not exist (expected a {what})") from e
    except IsADirectoryError as e:
        raise InputFileError(f"{path}: is a folder, not a {what}") from e
    except UnicodeDecodeError as e:
        raise InputFileError(f"{path}: is not a {what} (not UTF-8 text)") from e
    except OSError as e:
        raise InputFileError(f"{path}: cannot be read ({e.strerror})") from e
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputFileError(f"{path}: is not valid JSON ({e}); expected a {what}") from e


def write_file_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically (`core.atomic_files`): a crash
    leaves the old file or none, never a partial one.

    Raises:
        OSError: the folder cannot be created or written; `path` is left as it was.
    """
    return write_bytes_atomic(path, data.encode("utf-8") if isinstance(data, str) else data)


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """`data` as indented JSON at `path`, written like `write_file_atomic`."""
    return write_file_atomic(path, json.dumps(data, indent=2) + "\n")
