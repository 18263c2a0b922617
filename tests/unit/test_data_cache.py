"""`text:URL` and `image-folder:URL`: the object (or folder) fetched once into the data
folder's cache, read from there while the store says it is the same, fetched again when it
changed; a fetch that fails leaves nothing that looks complete; an outage within the retry
window is ridden out, one past it is one line; a missing object or an unknown scheme is
one line with exit code 2. On fsspec's real in-memory and local stores, and one whose
reads fail as a cut connection."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from disttrain.config import TrainingConfig
from disttrain.core import store_retry
from disttrain.data import describe_dataset, load_datasets, store_cache
from tests.unit.test_text_and_images import write_images

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).encode()


@pytest.fixture
def url():
    """A fresh object on fsspec's in-memory store, holding TEXT."""
    location = f"memory://data-{uuid.uuid4().hex[:8]}/corpus.txt"
    fsspec.filesystem("memory").pipe(location, TEXT)
    yield location
    fsspec.filesystem("memory").rm(location.rsplit("/", 1)[0], recursive=True)


@pytest.fixture
def window():
    yield store_retry.set_window
    store_retry.set_window(store_retry.DEFAULT_WINDOW_S)


def fetched_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("training.dataset: fetched")]


def test_an_object_is_fetched_once_and_then_read_from_the_cache(tmp_path, url, caplog):
    caplog.set_level(logging.INFO, logger="disttrain.data.store_cache")
    first = store_cache.local_copy(url, tmp_path)
    second = store_cache.local_copy(url, tmp_path)
    assert first == second and first.read_bytes() == TEXT
    assert first.parent == store_cache.cache_folder(url, tmp_path)
    assert first.parent.parent == tmp_path / "cache"
    assert len(fetched_lines(caplog)) == 1
    assert any("read from its cached copy" in r.getMessage() for r in caplog.records)
    assert not list(first.parent.glob(".*"))


def test_a_changed_object_is_fetched_again_and_said(tmp_path, url, caplog):
    caplog.set_level(logging.INFO, logger="disttrain.data.store_cache")
    old = store_cache.local_copy(url, tmp_path)
    fsspec.filesystem("memory").pipe(url, TEXT.upper())
    new = store_cache.local_copy(url, tmp_path)
    assert new != old and new.read_bytes() == TEXT.upper() and not old.exists()
    assert len(fetched_lines(caplog)) == 2
    assert f"training.dataset: {url} changed in the store since it was cached; fetching it again" in \
        [r.getMessage() for r in caplog.records]


def test_with_downloads_off_only_a_cached_copy_is_read(tmp_path, url):
    with pytest.raises(store_cache.DataSourceError, match="training.download is false") as raised:
        store_cache.local_copy(url, tmp_path, download=False)
    assert raised.value.exit_code == 2 and not (tmp_path / "cache").exists()
    copy = store_cache.local_copy(url, tmp_path)
    assert store_cache.local_copy(url, tmp_path, download=False) == copy


def test_a_text_url_loads_the_same_windows_as_the_local_file(tmp_path, url):
    local = tmp_path / "corpus.txt"
    local.write_bytes(TEXT)
    from_store = load_datasets(TrainingConfig(dataset=f"text:{url}", seq_len=16, data_dir=str(tmp_path)))
    from_file = load_datasets(TrainingConfig(dataset=f"text:{local}", seq_len=16))
    for remote, here in zip(from_store, from_file, strict=True):
        assert remote.name == here.name == "text:corpus.txt"
        assert torch.equal(remote.tokens, here.tokens) and torch.equal(remote.starts, here.starts)


def test_a_file_url_is_cached_as_any_store(tmp_path):
    source = tmp_path / "source" / "corpus.txt"
    source.parent.mkdir()
    source.write_bytes(TEXT)
    copy = store_cache.local_copy(f"file://{source}", tmp_path / "data")
    assert copy.read_bytes() == TEXT and copy.is_relative_to(tmp_path / "data" / "cache")


def test_a_missing_object_is_one_line_with_exit_code_2(tmp_path, url):
    absent = url.replace("corpus.txt", "absent.txt")
    with pytest.raises(store_cache.DataSourceError) as raised:
        store_cache.local_copy(absent, tmp_path)
    assert raised.value.exit_code == 2
    assert str(raised.value).startswith(f"training.dataset: {absent} cannot be read (FileNotFoundError")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))


def test_an_unknown_scheme_is_one_line_with_exit_code_2(tmp_path):
    with pytest.raises(store_cache.DataSourceError, match=r"unknown storage scheme 'nosuch'") as raised:
        load_datasets(TrainingConfig(dataset="text:nosuch://bucket/corpus.txt", seq_len=16,
                                     data_dir=str(tmp_path)))
    assert raised.value.exit_code == 2


class CutStore(MemoryFileSystem):
    """The in-memory store whose reads fail as a cut connection, `failures` times in all,
    after the first chunk (a fetch dies half-way)."""

    protocol = "cutmem"
    failures = 0

    def open(self, path, mode="rb", **kwargs):
        handle = super().open(path, mode, **kwargs)
        if "r" not in mode or CutStore.failures <= 0:
            return handle
        CutStore.failures -= 1
        return CutHandle(handle)


class CutHandle:
    """A store's file that gives its first 16 bytes, then fails as a connection reset."""

    def __init__(self, handle):
        self.handle, self.reads = handle, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def read(self, size=-1):
        self.reads += 1
        if self.reads > 1:
            raise ConnectionResetError("connection reset by peer")
        return self.handle.read(16)


@pytest.fixture
def cut_url(monkeypatch):
    fsspec.register_implementation("cutmem", CutStore, clobber=True)
    monkeypatch.setattr(store_cache, "CHUNK_BYTES", 16)
    location = f"cutmem://data-{uuid.uuid4().hex[:8]}/corpus.txt"
    CutStore().pipe(location, TEXT)
    yield location
    CutStore.failures = 0


def test_a_fetch_cut_half_way_is_retried_within_the_window(tmp_path, cut_url, window, caplog):
    window(30)
    CutStore.failures = 2
    copy = store_cache.local_copy(cut_url, tmp_path)
    assert copy.read_bytes() == TEXT and CutStore.failures == 0
    assert not list(copy.parent.glob(".*"))
    assert any("fetching the data set failed" in r.getMessage() for r in caplog.records)


def test_a_store_down_past_the_window_is_one_line_and_leaves_no_copy(tmp_path, cut_url, window):
    window(0)
    CutStore.failures = 1
    with pytest.raises(store_cache.DataStoreError) as raised:
        store_cache.local_copy(cut_url, tmp_path)
    assert raised.value.exit_code == 74 and "\n" not in str(raised.value)
    assert str(raised.value).startswith(f"training.dataset: {cut_url} could not be fetched for 0s "
                                        "(system.checkpoint_retry_s=0): ConnectionResetError")
    folder = store_cache.cache_folder(cut_url, tmp_path)
    assert not folder.exists() or list(folder.iterdir()) == []  # nothing that looks complete


@pytest.fixture
def folder_url(tmp_path):
    """A fresh folder of 2 classes of 5 PNG images each on fsspec's in-memory store, and
    its local original."""
    local = tmp_path / "original" / "pets"
    write_images(local)
    location = f"memory://images-{uuid.uuid4().hex[:8]}/pets"
    fsspec.filesystem("memory").put(str(local), location, recursive=True)
    yield location, local
    fsspec.filesystem("memory").rm(location.rsplit("/", 1)[0], recursive=True)


def test_an_image_folder_url_loads_as_the_local_folder_once_fetched(tmp_path, folder_url, caplog):
    caplog.set_level(logging.INFO, logger="disttrain.data.store_cache")
    url, local = folder_url
    config = TrainingConfig(dataset=f"image-folder:{url}", data_dir=str(tmp_path / "data"))
    assert describe_dataset(config) == describe_dataset(TrainingConfig(dataset=f"image-folder:{local}"))
    from_store = load_datasets(config)
    from_folder = load_datasets(TrainingConfig(dataset=f"image-folder:{local}"))
    for remote, here in zip(from_store, from_folder, strict=True):
        assert remote.name == here.name == "image-folder:pets"
        assert torch.equal(remote.images, here.images) and torch.equal(remote.labels, here.labels)
    num_bytes = sum(p.stat().st_size for p in local.rglob("*.png"))
    assert fetched_lines(caplog) == [f"training.dataset: fetched {url} (10 objects, {num_bytes} bytes) into "
                                     f"{store_cache.local_folder(url, tmp_path / 'data')}"]


def test_a_changed_image_folder_is_fetched_again(tmp_path, folder_url):
    url, local = folder_url
    first = store_cache.local_folder(url, tmp_path)
    fsspec.filesystem("memory").pipe(f"{url}/cat/extra.png", (local / "cat" / "0.png").read_bytes())
    second = store_cache.local_folder(url, tmp_path)
    assert second != first and not first.exists() and (second / "cat" / "extra.png").is_file()
    assert sorted(p.relative_to(second) for p in second.rglob("*.png")) == \
        sorted([p.relative_to(local) for p in local.rglob("*.png")] + [Path("cat/extra.png")])


def test_a_missing_image_folder_is_one_line_with_exit_code_2(tmp_path, folder_url):
    absent = folder_url[0].replace("pets", "absent")
    with pytest.raises(store_cache.DataSourceError) as raised:
        store_cache.local_folder(absent, tmp_path)
    assert raised.value.exit_code == 2 and str(raised.value).startswith(
        f"training.dataset: {absent} cannot be read (FileNotFoundError")
