"""Checkpoints on object storage (fsspec URLs), against fsspec's in-memory store: a checkpoint
is complete only with a matching sidecar, listing and pruning see complete ones only, a
resume takes the newest complete one, and a missing backend is a config error."""

import uuid

import fsspec
import pytest
import torch

from disttrain.config import load_config
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import CheckpointError, ConfigError
from disttrain.core.saver import CheckpointWriter
from disttrain.training.checkpoints import LocalCheckpoints


@pytest.fixture
def folder():
    """A fresh folder of the in-memory store (shared by the whole process: a unique name)."""
    url = f"memory://disttrain-test-{uuid.uuid4().hex}/ckpt"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def names(url):
    return sorted(object_store.basename(p) for p in fsspec.filesystem("memory").ls(url, detail=False))


def state(step):
    return {"step": step, "w": torch.full((3,), float(step))}


def test_save_list_load_and_prune(folder):
    for step in (5, 10, 15, 20):
        ckpt.save_checkpoint(folder, step, state(step), keep=2)
    found = ckpt.list_checkpoints(folder)
    assert found == [f"{folder}/checkpoint_step00000015.pt", f"{folder}/checkpoint_step00000020.pt"]
    assert names(folder) == ["checkpoint_step00000015.pt", "checkpoint_step00000015.pt.sha256",
                             "checkpoint_step00000020.pt", "checkpoint_step00000020.pt.sha256"]
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(folder))
    assert loaded["step"] == 20 and torch.equal(loaded["w"], torch.full((3,), 20.0))
    assert ckpt.checkpoint_step(found[-1]) == 20


def test_an_object_without_its_sidecar_is_no_checkpoint(folder):
    """An upload cut before its sidecar: never listed, never chosen; a resume takes the
    newest complete one, and the start of a run removes the incomplete object."""
    ckpt.save_checkpoint(folder, 10, state(10))
    ckpt.save_checkpoint(folder, 20, state(20))
    fs = fsspec.filesystem("memory")
    fs.rm_file(f"{folder}/checkpoint_step00000020.pt.sha256")
    fs.pipe_file(f"{folder}/checkpoint_step00000030.pt", b"PK\x03\x04 half an upload")
    assert ckpt.latest_checkpoint(folder) == f"{folder}/checkpoint_step00000010.pt"
    with pytest.raises(CheckpointError, match="no .sha256 sidecar"):
        ckpt.load_checkpoint(f"{folder}/checkpoint_step00000030.pt")
    path, loaded = ckpt.open_checkpoint_dir(folder, resume=True)
    assert path == f"{folder}/checkpoint_step00000010.pt" and loaded["step"] == 10
    assert names(folder) == ["checkpoint_step00000010.pt", "checkpoint_step00000010.pt.sha256"]


@pytest.mark.parametrize("damage", ["truncated", "wrong-sum", "malformed-sum"])
def test_a_sidecar_that_does_not_match_is_skipped_for_the_previous(folder, damage, caplog):
    ckpt.save_checkpoint(folder, 10, state(10))
    ckpt.save_checkpoint(folder, 20, state(20))
    fs = fsspec.filesystem("memory")
    newest = f"{folder}/checkpoint_step00000020.pt"
    if damage == "truncated":
        fs.pipe_file(newest, fs.cat_file(newest)[:100])
    else:
        fs.pipe_file(newest + ".sha256", b"0" * 64 + b"  x\n" if damage == "wrong-sum" else b"nonsense\n")
    with pytest.raises(CheckpointError, match="checksum|malformed"):
        ckpt.load_checkpoint(newest)
    path, loaded = ckpt.load_latest_good_checkpoint(folder)
    assert path == f"{folder}/checkpoint_step00000010.pt" and loaded["step"] == 10
    assert "skipping checkpoint checkpoint_step00000020.pt" in caplog.text


def test_a_failed_save_leaves_no_checkpoint_and_keeps_the_previous(folder):
    ckpt.save_checkpoint(folder, 10, state(10))

    class Unsavable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError):
        ckpt.save_checkpoint(folder, 20, {"v": Unsavable()})
    assert names(folder) == ["checkpoint_step00000010.pt", "checkpoint_step00000010.pt.sha256"]
    assert ckpt.latest_checkpoint(folder) == f"{folder}/checkpoint_step00000010.pt"


def test_overwriting_removes_the_old_sum_first(folder, monkeypatch):
    """While a checkpoint is overwritten, its old sum never vouches for the new bytes: a
    write cut after the data leaves the step absent, not wrongly verified."""
    ckpt.save_checkpoint(folder, 10, state(10))
    written = []
    original = object_store.StoreFolder.write

    def cut_before_sidecar(self, name, fill):
        if name.endswith(".sha256"):
            written.append(name)
            raise OSError("connection reset")
        return original(self, name, fill)

    monkeypatch.setattr(object_store.StoreFolder, "write", cut_before_sidecar)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(folder, 10, state(99))
    assert written == ["checkpoint_step00000010.pt.sha256"]
    assert ckpt.list_checkpoints(folder) == []


def test_a_fresh_run_refuses_a_folder_with_checkpoints(folder):
    ckpt.save_checkpoint(folder, 10, state(10))
    with pytest.raises(ConfigError, match="already holds checkpoints .newest checkpoint_step00000010.pt"):
        ckpt.prepare_checkpoint_dir(folder, resume=False)
    assert ckpt.prepare_checkpoint_dir(f"{folder}-other", resume=False) is None


def test_resume_through_local_checkpoints_reads_the_newest_complete_one(folder):
    store = LocalCheckpoints(folder, keep=3)
    assert store.choose(resume=True) is None  # nothing there yet: start from the beginning
    for step in (5, 10):
        store.save(step, state(step))
    fsspec.filesystem("memory").rm_file(f"{folder}/checkpoint_step00000010.pt.sha256")
    again = LocalCheckpoints(folder, keep=3)
    chosen = again.choose(resume=True)
    assert chosen == f"{folder}/checkpoint_step00000005.pt" and again.load(chosen)["step"] == 5


def test_the_background_writer_writes_to_a_store(folder):
    writer = CheckpointWriter(folder, keep=2)
    for step in (1, 2, 3):
        writer.submit(step, state(step))
        writer.flush(timeout_s=30)
    writer.close(timeout_s=30)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(folder)] == [2, 3]


def test_the_final_model_and_evaluation_files_go_to_the_store(folder):
    path = object_store.join(folder, "baseline_final.pt")
    assert path == f"{folder}/baseline_final.pt"

    class Config:
        def to_dict(self):
            return {"seed": 1}

    ckpt.save_final_model(path, {"w": torch.ones(2)}, Config())
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.ones(2))


def test_urls_and_paths_are_told_apart(tmp_path):
    assert object_store.is_url("s3://bucket/run") and object_store.is_url("memory://x")
    assert not object_store.is_url("runs/ckpt") and not object_store.is_url(tmp_path)
    assert object_store.join(tmp_path, "a.pt") == tmp_path / "a.pt"
    assert object_store.join("s3://bucket/run/", "a.pt") == "s3://bucket/run/a.pt"


def test_a_scheme_without_its_backend_is_a_config_error(monkeypatch):
    def missing(protocol):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ConfigError, match=r"system.checkpoint_dir: 's3://b/run': the s3:// backend is not "
                                          r"installed; pip install 'disttrain\[s3\]'"):
        load_config(flags={"system.checkpoint_dir": "s3://b/run"})


def test_an_unknown_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown storage scheme 'nosuchstore'"):
        load_config(flags={"system.checkpoint_dir": "nosuchstore://b/run"})


def test_small_objects_beside_checkpoints_on_a_store_and_on_disk(folder, tmp_path):
    """`write_bytes`, `read_bytes` and `exists` take a URL or a path alike (a PS worker's key,
    the checkpoint a DDP rank checks before loading); a local file keeps its mode."""
    for location in (object_store.join(folder, "worker0/worker.key"), tmp_path / "worker0" / "worker.key"):
        assert not object_store.exists(location)
        with pytest.raises(FileNotFoundError):
            object_store.read_bytes(location)
        object_store.write_bytes(location, b"k" * 32, mode=0o600)
        assert object_store.exists(location)
        assert object_store.read_bytes(location) == b"k" * 32
    assert names(object_store.join(folder, "worker0")) == ["worker.key"]
    assert (tmp_path / "worker0" / "worker.key").stat().st_mode & 0o777 == 0o600
    ckpt.save_checkpoint(folder, 5, state(5), keep=2)
    assert object_store.exists(object_store.join(folder, ckpt.checkpoint_name(5)))
    assert ckpt.list_checkpoints(object_store.join(folder, "worker0")) == []  # a key is no checkpoint
