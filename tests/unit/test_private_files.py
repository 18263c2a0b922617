"""What the project creates that names the run's nodes or holds its work is private to
its owner from its first byte, whatever the umask lets through: the coordinator's
registry (and sqlite's files beside it), a process's log file, checkpoints."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from disttrain.coordinator.registry import Registry
from disttrain.core.atomic_files import atomic_torch_save
from disttrain.core.logs import open_log, setup_logging

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def open_umask():
    previous = os.umask(0o022)  # the usual one: files readable by everyone
    yield
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_registry_and_sqlites_files_beside_it_are_private(tmp_path, open_umask):
    registry = Registry(tmp_path / "run" / "registry.db")
    try:
        files = sorted(tmp_path.glob("run/registry.db*"))
        assert {path.name for path in files} >= {"registry.db", "registry.db-wal"}
        assert {path.name: mode(path) for path in files} == {path.name: 0o600 for path in files}
    finally:
        registry.close()


def test_a_log_file_is_private(tmp_path, open_umask):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("server", 0, log_file=tmp_path / "logs" / "server0.log")
        logging.getLogger("disttrain.test").warning("a line")
        assert mode(tmp_path / "logs" / "server0.log") == 0o600
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def test_a_childs_log_is_private(tmp_path, open_umask):
    """The launchers' children write their output through `open_log` (`core.processes`)."""
    with open_log(tmp_path / "worker0.log") as log:
        log.write(b"a line\n")
    with open_log(tmp_path / "worker0.log") as log:  # appended to, as a restarted child's
        log.write(b"another\n")
    assert (tmp_path / "worker0.log").read_bytes() == b"a line\nanother\n"
    assert mode(tmp_path / "worker0.log") == 0o600


def test_a_checkpoint_is_private(tmp_path, open_umask):
    path = atomic_torch_save({"weights": torch.zeros(2)}, tmp_path / "ckpt" / "step_1.pt")
    assert mode(path) == 0o600
