"""The error file a failing rank leaves for the elastic agent, written atomically.

torch's `ErrorHandler` opens the file and then writes it. The agent stops the other ranks
as soon as one fails, and a rank stopped between the two left an empty file, which the
agent then failed to parse (`json.JSONDecodeError` inside the agent: the launcher itself
crashed instead of restarting the group; seen once in CI after a rank was killed). Written
to a temporary file and renamed into place, the file is whole or absent.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler


class AtomicErrorHandler(ErrorHandler):
    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        temporary = f"{file_path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w") as handle:
                handle.write(error_msg)
            os.replace(temporary, file_path)
        except OSError:  # as torch does: a rank that cannot write it still exits with its code
            super()._write_error_file(file_path, error_msg)
