"""Helpers of the tests that drive live DDP runs from the command line: start `disttrain
ddp` as a user would, wait for a line in a log (never a sleep as synchronisation), find a
rank's process, and count the samples of an epoch's whole global batches."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from disttrain.config import TrainingConfig
from disttrain.core import forking
from disttrain.data import load_datasets

WAIT_S = 150.0
POLL_S = 0.05  # how often a log is read again while waiting for a line


def samples_per_epoch(global_batch: int, dataset: str = "digits") -> int:
    """The samples of an epoch's whole global batches."""
    train_set, _ = load_datasets(TrainingConfig(dataset=dataset))
    return len(train_set) // global_batch * global_batch


def start(args: list, output: Path) -> subprocess.Popen | forking.ForkedProcess:
    """`disttrain ddp ARGS`, its output into the file at `output`: forked from the test's
    fork server, as a launcher starts its children (`forking.start`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with output.open("w") as sink:
        return forking.start([sys.executable, "-m", "disttrain", "ddp", *map(str, args)], env,
                             sink.fileno(), sink.fileno())


def wait_for(path: Path, pattern: str | re.Pattern, *processes: subprocess.Popen) -> re.Match:
    """The first match of `pattern` in the file at `path`, once written; fails at the
    deadline, or when one of `processes` ends first."""
    deadline = time.monotonic() + WAIT_S
    pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
    while time.monotonic() < deadline:
        found = pattern.search(path.read_text(errors="replace")) if path.exists() else None
        if found:
            return found
        ended = [p for p in processes if p.poll() is not None]
        assert not ended, f"{ended[0].args} ended ({ended[0].returncode}) before {pattern.pattern!r} " \
                          f"in {path}"
        time.sleep(POLL_S)
    pytest.fail(f"no {pattern.pattern!r} in {path} within {WAIT_S:.0f}s")


def parent_of(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def serves(fork_server: int, launcher: int) -> bool:
    """Whether process `fork_server` is the fork server of process `launcher`: its child
    (the launcher started it), or a fork server forked for it (its command line names it)."""
    if parent_of(fork_server) == launcher:
        return True
    try:
        argv = (Path("/proc") / str(fork_server) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[:2] == [b"disttrain-fork-server", f"--launcher={launcher}".encode()]


def rank_pid(launcher: subprocess.Popen, slot: int) -> int:
    """The process id of `launcher`'s rank `slot` (a process running the rank entry point,
    its child or its fork server's)."""
    return launcher_rank(launcher, lambda state, argv: argv[argv.index(b"--rank") + 1] == str(slot).encode(),
                         f"rank {slot}")


def launcher_rank(launcher: subprocess.Popen, matches: Callable[[str, list[bytes]], bool], what: str) -> int:
    """The process id of a rank of `launcher` (a process running the rank entry point, its
    child or its fork server's) for which `matches(state, argv)` holds: its one-letter state
    in /proc (T: stopped) and its command line."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            parent = int(stat[1])
            if ((parent == launcher.pid or serves(parent, launcher.pid)) and b"disttrain.torchrun" in argv
                    and matches(stat[0], argv)):
                return int(entry.name)
        assert launcher.poll() is None, f"the launcher ended ({launcher.returncode}) before {what}"
        time.sleep(POLL_S)
    pytest.fail(f"{what} of {launcher.args} not found within {WAIT_S:.0f}s")


def stop(*processes: subprocess.Popen | None) -> None:
    """Kill whichever of `processes` still runs (a test's cleanup)."""
    for process in processes:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
