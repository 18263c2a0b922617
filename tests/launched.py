"""Start `python -m disttrain ...` from a test as `subprocess.Popen` would, but forked from
the test's fork server (`forking.start`, as a launcher starts its children): torch and the
command line are imported once for the test process, not once a launch (a new interpreter
takes seconds of CPU to import them; `DISTTRAIN_FORK_SERVER=0` starts one anyway).
`Launched` keeps the part of `Popen`'s interface the tests use. It always runs in a session
of its own with stdin from /dev/null, as a launcher's children do."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import IO, Any

from disttrain.core import forking

# What a stream may be given as: subprocess.PIPE, DEVNULL or STDOUT (stderr only), a file
# object or descriptor, or None (this process's own).
Stream = int | IO[Any] | None


class Launched:
    """`subprocess.Popen(command, stdout=..., stderr=..., env=..., text=..., cwd=...)` for a
    `python [-u] -m MODULE ARGS` command, forked where it can be. `parent_env`: a variable
    it finds set to its parent's pid (`forking.ForkedProcess`), as a launcher's children do."""

    def __init__(self, command: list[str], *, stdout: Stream = None, stderr: Stream = None,
                 env: dict[str, str] | None = None, text: bool = False, cwd: str | os.PathLike | None = None,
                 parent_env: str | None = None):
        self.args = command
        pipes: dict[str, int] = {}
        ours: list[int] = []  # descriptors this process opened for the child, closed once it has them

        def target(stream: Stream, name: str, own: int) -> int:
            if stream == subprocess.PIPE:
                read, write = os.pipe()
                pipes[name] = read
                ours.append(write)
                return write
            if stream == subprocess.DEVNULL:
                ours.append(os.open(os.devnull, os.O_WRONLY))
                return ours[-1]
            if stream is None:
                return own
            return stream if isinstance(stream, int) else stream.fileno()

        try:
            out = target(stdout, "stdout", 1)
            err = out if stderr == subprocess.STDOUT else target(stderr, "stderr", 2)
            self.process = forking.start(command, dict(os.environ if env is None else env), out, err,
                                         parent_env=parent_env, cwd=cwd)
        except BaseException:
            for fd in pipes.values():
                os.close(fd)
            raise
        finally:
            for fd in ours:
                os.close(fd)
        mode = "r" if text else "rb"
        self.stdout: IO[Any] | None = open(pipes["stdout"], mode) if "stdout" in pipes else None  # noqa: SIM115
        self.stderr: IO[Any] | None = open(pipes["stderr"], mode) if "stderr" in pipes else None  # noqa: SIM115
        self.pid = self.process.pid
        self._readers: list[threading.Thread] | None = None  # (`communicate`)
        self._read: dict[str, Any] = {}

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout=timeout)

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """The rest of its stdout and stderr (those that are pipes), once it has exited.
        As `Popen`'s: after a timeout, call it again (having killed the process, say) for
        everything it wrote.

        Raises:
            subprocess.TimeoutExpired: not within `timeout` (it runs on).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:  # read to their ends from threads, once, whatever the calls
            streams = {"stdout": self.stdout, "stderr": self.stderr}
            read = self._read
            self._readers = [threading.Thread(target=lambda n=name, s=stream: read.update({n: s.read()}),
                                              daemon=True) for name, stream in streams.items() if stream]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return self._read.get("stdout"), self._read.get("stderr")

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()
