"""The error file a failing rank leaves for the elastic agent, written atomically.

torch's `ErrorHandler.record_exception` opens the file and then writes it. The agent
stops the other ranks as soon as one fails, and a rank stopped between the two left an
empty file, which the agent then failed to parse (`json.JSONDecodeError` inside the
agent: the launcher itself crashed instead of restarting the group; seen in CI after a
rank was killed). Written to a temporary file and renamed into place, the file is whole
or absent, and the agent reads an absent one as a failure without a message.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler


class AtomicErrorHandler(ErrorHandler):
    def record_exception(self, e: BaseException) -> None:
        """The exception, in the agent's format (as torch writes it), or nothing when the
        rank was not started by an agent."""
        path = self._get_error_file_path()
        if not path:
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": traceback.format_exc(),
                                          "timestamp": str(int(time.time()))}}}
        self._write_error_file(path, json.dumps(data))

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        temporary = f"{file_path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w") as handle:
                handle.write(error_msg)
            os.replace(temporary, file_path)
        except OSError:  # as torch does: a rank that cannot write it still exits with its code
            super()._write_error_file(file_path, error_msg)
