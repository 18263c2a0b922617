"""Checkpoint durability: checksums, falling back past damaged checkpoints, leftover
temporary files, and the bounded background writer."""

import gc
import hashlib
import logging
import threading
import weakref

import pytest
import torch

from disttrain.core import checkpoint as ckpt
from disttrain.core.atomic_files import sidecar_path
from disttrain.core.errors import CheckpointError
from disttrain.core.saver import CheckpointWriter
from disttrain.training.checkpoints import LocalCheckpoints

pytestmark = pytest.mark.timeout(30)


def save_steps(folder, *steps, keep=10):
    return [ckpt.save_checkpoint(folder, step, {"step": step, "w": torch.full((5000,), float(step))},
                                 keep=keep) for step in steps]


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flipped":
        flip_byte(path, len(data) // 2)
    elif how == "bad sum file":
        sidecar_path(path).write_text("not a sum\n")
    elif how == "no sum file":
        sidecar_path(path).unlink()


def test_every_save_writes_a_sha256sum_style_sidecar(tmp_path):
    (path,) = save_steps(tmp_path, 7)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sidecar_path(path).read_text() == f"{digest}  {path.name}\n"


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    (path,) = save_steps(tmp_path, 7)
    flip_byte(path, len(path.read_bytes()) // 2)  # inside the tensor's raw bytes
    with pytest.raises(CheckpointError, match=r"checkpoint_step00000007\.pt is corrupt.*checksum"):
        ckpt.load_checkpoint(path)
    # torch.load alone reads the damaged tensor as if nothing were wrong: the sum catches it
    assert not torch.equal(torch.load(path, weights_only=True)["w"], torch.full((5000,), 7.0))


def test_a_checkpoint_without_its_sum_is_refused_and_a_resume_takes_the_one_before(tmp_path):
    older, newer = save_steps(tmp_path, 4, 8)
    torch.save({"step": 12, "w": torch.ones(3)}, tmp_path / ckpt.checkpoint_name(12))  # no sidecar
    for path in (tmp_path / ckpt.checkpoint_name(12), newer):
        sidecar_path(path).unlink(missing_ok=True)
        with pytest.raises(CheckpointError, match=rf"{path.name} has no checksum file {path.name}\.sha256"):
            ckpt.load_checkpoint(path)
    assert ckpt.prepare_checkpoint_dir(tmp_path, resume=True) == older
    with pytest.raises(CheckpointError, match=r"checkpoint_step00000099\.pt does not exist"):
        ckpt.load_checkpoint(tmp_path / ckpt.checkpoint_name(99))


def test_pruning_removes_the_sums_with_their_checkpoints(tmp_path):
    save_steps(tmp_path, 1, 2, 3, 4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_step00000003.pt", "checkpoint_step00000003.pt.sha256",
        "checkpoint_step00000004.pt", "checkpoint_step00000004.pt.sha256"]


@pytest.mark.parametrize("how", ["truncated", "empty", "flipped", "bad sum file", "no sum file"])
def test_a_damaged_newest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog, how):
    paths = save_steps(tmp_path, 10, 20, 30)
    damage(paths[-1], how)
    with caplog.at_level(logging.WARNING, logger="disttrain.core.checkpoint"):
        assert ckpt.prepare_checkpoint_dir(tmp_path, resume=True) == paths[1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and paths[-1].name in warnings[0]
    path, state = ckpt.load_latest_good_checkpoint(tmp_path)
    assert path == paths[1] and state["step"] == 20
    assert paths[-1].exists()  # skipped, not deleted


def test_every_checkpoint_damaged_is_an_error_naming_them(tmp_path):
    paths = save_steps(tmp_path, 1, 2)
    damage(paths[0], "truncated")
    damage(paths[1], "flipped")
    with pytest.raises(CheckpointError, match="checkpoint_step00000001.pt, checkpoint_step00000002.pt"):
        ckpt.prepare_checkpoint_dir(tmp_path, resume=True)
    assert ckpt.load_latest_good_checkpoint(tmp_path / "empty") is None


def test_local_checkpoints_resume_from_the_good_one_and_read_it_once(tmp_path, monkeypatch):
    paths = save_steps(tmp_path, 1, 2)
    damage(paths[1], "truncated")
    loads = []
    real_load = ckpt.load_checkpoint
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda path: loads.append(path) or real_load(path))
    store = LocalCheckpoints(tmp_path, keep=3)
    assert store.choose(resume=True) == paths[0]
    assert store.load(paths[0])["step"] == 1
    assert loads == [paths[1], paths[0]]  # the damaged one tried, the good one read once
    assert store.load(paths[0])["step"] == 1 and loads[-1] == paths[0]  # later loads read the file


@pytest.mark.parametrize("resume", [False, True])
def test_prepare_removes_leftover_temporary_files_and_nothing_else(tmp_path, resume):
    if resume:
        save_steps(tmp_path, 3)
    leftovers = [".x.tmp", ".checkpoint_step00000004.pt.k2j_9a1b.tmp",
                 ".checkpoint_step00000004.pt.sha256.0a1b2c3d.tmp"]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"partial")
    kept = ["x.tmp", ".hidden", "notes.tmp.txt", ".tmp", "checkpoint_step00000004.pt.sha256"]
    for name in kept:
        (tmp_path / name).write_bytes(b"mine")
    (tmp_path / ".folder.tmp").mkdir()
    before = {p.name for p in tmp_path.iterdir()}
    chosen = ckpt.prepare_checkpoint_dir(tmp_path, resume=resume)
    assert (chosen is not None) == resume
    assert {p.name for p in tmp_path.iterdir()} == before - set(leftovers)


def submit_snapshot(writer, step, alive):
    """Submit a snapshot holding a tensor; record a weak reference to see when it is freed."""
    tensor = torch.full((1000,), float(step))
    alive[step] = weakref.ref(tensor)
    writer.submit(step, {"step": step, "w": tensor})


def test_writer_holds_one_write_in_flight_and_only_the_latest_waiting(tmp_path, monkeypatch):
    started, release, written = threading.Event(), threading.Event(), []
    real_save = ckpt.save_checkpoint

    def slow_save(folder, step, state, keep):
        written.append(step)
        if step == 1:
            started.set()
            release.wait(10)
        return real_save(folder, step, state, keep)

    monkeypatch.setattr(ckpt, "save_checkpoint", slow_save)
    writer, alive = CheckpointWriter(tmp_path, keep=5), {}
    submit_snapshot(writer, 1, alive)
    assert started.wait(10)
    for step in (2, 3, 4):
        submit_snapshot(writer, step, alive)
    gc.collect()
    assert {step for step, ref in alive.items() if ref() is not None} == {1, 4}  # two copies at most
    release.set()
    writer.close(timeout_s=10)
    assert written == [1, 4]
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == [1, 4]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == 4
    gc.collect()
    assert all(ref() is None for ref in alive.values())


class ErrorSeen(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.seen = threading.Event()

    def emit(self, record):
        self.seen.set()


def test_a_failed_write_surfaces_at_flush_and_at_the_next_submit(tmp_path, monkeypatch, caplog):
    real_save = ckpt.save_checkpoint

    def full_disk(folder, step, state, keep):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.submit(1, {"step": 1})
    with pytest.raises(CheckpointError, match=r"checkpoint_step00000001\.pt \(.*No space left on device"):
        writer.flush(timeout_s=10)
    assert any(r.levelno == logging.ERROR and r.name == "disttrain.core.saver" for r in caplog.records)
    writer.flush(timeout_s=10)  # raised once; nothing new failed since

    handler = ErrorSeen()
    logging.getLogger("disttrain.core.saver").addHandler(handler)
    try:
        writer.submit(2, {"step": 2})
        assert handler.seen.wait(10)
    finally:
        logging.getLogger("disttrain.core.saver").removeHandler(handler)
    with pytest.raises(CheckpointError, match=r"checkpoint_step00000002\.pt"):
        writer.submit(3, {"step": 3})

    monkeypatch.setattr(ckpt, "save_checkpoint", real_save)  # the disk recovers: writing goes on
    writer.submit(4, {"step": 4})
    writer.close(timeout_s=10)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint_step00000004.pt"]
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(5, {"step": 5})


def test_close_raises_what_the_last_write_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *args, **kwargs: 1 / 0)
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.submit(1, {"step": 1})
    with pytest.raises(CheckpointError, match="division by zero") as raised:
        writer.close(timeout_s=10)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    with pytest.raises(ValueError, match="keep"):
        CheckpointWriter(tmp_path, keep=0)
