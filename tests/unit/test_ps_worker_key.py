"""A worker's key: kept private in its checkpoint folder, the same again on --resume."""

import stat
import uuid

import fsspec

from disttrain.strategies.ps.run.worker import KEY_FILE, keep_key, worker_key
from disttrain.strategies.ps.server.members import MIN_KEY_BYTES


def test_a_resumed_worker_presents_its_key_again_and_a_fresh_one_another(tmp_path):
    folder = tmp_path / "worker1"
    key = worker_key(folder, resume=False)
    assert len(key) >= MIN_KEY_BYTES
    keep_key(folder, key)
    assert stat.S_IMODE((folder / KEY_FILE).stat().st_mode) == 0o600
    assert worker_key(folder, resume=True) == key
    assert worker_key(folder, resume=False) != key
    assert worker_key(tmp_path / "nothing-here", resume=True) != key  # no key kept: a new one


def test_a_damaged_key_file_gives_a_new_key(tmp_path):
    (tmp_path / KEY_FILE).write_bytes(b"short")
    assert len(worker_key(tmp_path, resume=True)) >= MIN_KEY_BYTES


def test_a_worker_on_a_store_keeps_its_key_there():
    """With `--checkpoint-dir` a store's URL the key is an object in the worker's folder there."""
    folder = f"memory://disttrain-test-{uuid.uuid4().hex}/ckpt/worker1"
    key = worker_key(folder, resume=False)
    keep_key(folder, key)
    assert fsspec.filesystem("memory").cat_file(f"{folder}/{KEY_FILE}") == key
    assert worker_key(folder, resume=True) == key
    assert worker_key(f"memory://disttrain-test-{uuid.uuid4().hex}/none", resume=True) != key
    fsspec.filesystem("memory").rm(folder.split("/ckpt")[0], recursive=True)
