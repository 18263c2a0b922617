"""`shards:DIR` (`data.shards`, `data.shard_reader`): a folder of `.npz` shards and its index,
on disk or at a URL (fsspec's in-memory store here; a real S3 server in the integration
tests), read shard by shard: batches equal the arrays written, within the bounds of the
disk cache and of memory, the next shards of the plan read ahead by the thread, and bad
folders refused in one line."""

import io
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.config.loading import load_config
from disttrain.core.errors import ConfigError, DataError
from disttrain.data import load_datasets
from disttrain.data.shard_reader import ReaderLimits, ShardFiles, ShardReader
from disttrain.data.shards import load_shards, parse_index, shard_layout, write_shards

fsspec = pytest.importorskip("fsspec")


def arrays(num: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num, 2, 3)).astype(np.float32), rng.integers(0, 5, num)


def training(location, tmp_path, **keys) -> TrainingConfig:
    return TrainingConfig(dataset=f"shards:{location}", data_dir=str(tmp_path / "data"), **keys)


def memory_url() -> str:
    return f"memory://shards-{uuid.uuid4().hex[:8]}/set"


def cached_bytes(tmp_path) -> int:
    return sum(p.stat().st_size for p in (tmp_path / "data" / "cache").rglob("*") if p.is_file()
               and "index.json" not in p.parent.name)


def test_batches_are_the_rows_written_in_any_order_of_indices(tmp_path):
    train, test = arrays(50), arrays(12, seed=1)
    spec = write_shards(tmp_path / "set", train, test, samples_per_shard=8)
    assert spec == f"shards:{tmp_path / 'set'}"
    train_set, test_set = load_datasets(training(tmp_path / "set", tmp_path))
    assert len(train_set) == 50 and len(test_set) == 12
    assert train_set.description.input_shape == (2, 3) and train_set.description.num_classes == 5
    indices = torch.tensor([49, 0, 17, 8, 8, 33, 7])
    x, y = train_set.batch(indices)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(train[0][indices.numpy()]))
    assert torch.equal(y, torch.from_numpy(train[1][indices.numpy()]))
    assert torch.equal(test_set.batch(torch.arange(12))[1], torch.from_numpy(test[1]))


def test_a_subset_is_the_first_samples_and_the_layout_its_shards(tmp_path):
    write_shards(tmp_path / "set", arrays(50), arrays(10), samples_per_shard=8)
    config = training(tmp_path / "set", tmp_path, max_train_samples=20)
    train_set, _ = load_datasets(config)
    assert len(train_set) == 20 and train_set.shard_sizes == (8, 8, 4)
    assert shard_layout(config).shard_sizes == (8, 8, 4)
    assert shard_layout(TrainingConfig(dataset="digits")) is None


def test_memory_holds_at_most_its_bound(tmp_path):
    write_shards(tmp_path / "set", arrays(64), arrays(8), samples_per_shard=8)
    train_set, _ = load_datasets(training(tmp_path / "set", tmp_path, num_shards_in_memory=2,
                                          num_shards_ahead=0))
    for start in range(0, 64, 8):
        train_set.batch(torch.arange(start, start + 8))
        assert len(train_set.reader._memory) <= 2
    assert train_set.reader.stats.read_on_demand == 8 and train_set.reader.stats.read_ahead == 0


def test_the_disk_cache_of_a_store_stays_within_its_bound_and_reads_every_row(tmp_path):
    url = memory_url()
    train, test = arrays(96), arrays(8)
    write_shards(url, train, test, samples_per_shard=8)
    shard_bytes = len(fsspec.filesystem("memory").cat(f"{url}/train-00000.npz"))
    bound = 3 * shard_bytes
    train_set, _ = load_datasets(training(url, tmp_path, shard_cache_bytes=bound, num_shards_in_memory=2,
                                          num_shards_ahead=1))
    order = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    for start in range(0, 96, 16):
        batch = order[start:start + 16]
        x, _ = train_set.batch(batch)
        assert torch.equal(x, torch.from_numpy(train[0][batch.numpy()]))
        assert cached_bytes(tmp_path) <= bound
    train_set.reader.close()
    assert 0 < cached_bytes(tmp_path) <= bound < 12 * shard_bytes


def two_readers_of_one_cache(tmp_path: Path) -> tuple[list[str], int, ShardReader, ShardReader]:
    """Two readers of five 8-sample shards sharing one cache bounded at three shards (a run's
    two workers), the second holding shards 1, 2 and 3: the shards' names, a shard's bytes,
    the two readers."""
    url = memory_url()
    write_shards(url, arrays(40), arrays(8), samples_per_shard=8)
    files = [f"train-{i:05d}.npz" for i in range(5)]
    shard_bytes = len(fsspec.filesystem("memory").cat(f"{url}/{files[0]}"))
    limits = ReaderLimits(cache_bytes=3 * shard_bytes, num_in_memory=1, num_ahead=0)
    one, other = (ShardReader(ShardFiles(url, tuple(files), ("x", "y")), str(tmp_path / "data"), True, limits)
                  for _ in range(2))
    for shard in (1, 2, 3):
        other.arrays(shard)
    return files, shard_bytes, one, other


def test_processes_sharing_a_bounded_cache_remove_the_least_recently_used_copy_of_any_of_them(tmp_path):
    """Two readers of one cache (a run's two workers): the one that bounds the disk removes
    the copy least recently used by either, never the other's fresh fetch, which the other
    has still to read (a parameter-server run on S3 shards had a worker read a copy its
    peer had just removed, twice in a row, and fail)."""
    files, shard_bytes, one, other = two_readers_of_one_cache(tmp_path)
    one.arrays(0)  # over the bound: the oldest use goes, shard 1
    other.arrays(4)  # over it again: shard 2, not the other reader's shard 0
    on_disk = {f for f in files if any((tmp_path / "data" / "cache").glob(f"*-{f}/*"))}
    assert on_disk == {files[0], files[3], files[4]}
    assert cached_bytes(tmp_path) <= 3 * shard_bytes


def test_the_next_shards_of_the_plan_are_read_ahead_by_the_thread(tmp_path):
    url = memory_url()
    write_shards(url, arrays(80), arrays(8), samples_per_shard=8)
    config = training(url, tmp_path, num_shards_in_memory=4, num_shards_ahead=2)
    train_set, _ = load_datasets(config)
    plan = [3, 7, 1, 0, 9, 2]  # shards in this process's order
    batches = [torch.arange(s * 8, s * 8 + 8) for s in plan]
    shard_layout(config).read_ahead(batches)  # the loop's call: the same reader
    train_set.batch(batches[0])
    train_set.batch(batches[1])
    reader = train_set.reader
    reader.wait()  # for the reads in flight: no timing involved
    ahead = reader.stats.names_read_ahead
    # The plan's first three when it was given, then one more as each batch moved the cursor:
    # the thread read, in the plan's order, every shard the two batches asked for and the
    # next two after the second; the steps read none themselves.
    assert ahead == [f"train-{s:05d}.npz" for s in plan[:4]]
    assert reader.stats.read_on_demand == 0 and reader.stats.read_ahead == 4


def test_a_reader_pickles_empty_and_reads_again(tmp_path):
    write_shards(tmp_path / "set", arrays(16), arrays(8), samples_per_shard=8)
    train_set, _ = load_datasets(training(tmp_path / "set", tmp_path))
    train_set.batch(torch.arange(16))
    import pickle

    copy = pickle.loads(pickle.dumps(train_set))
    assert not copy.reader._memory
    assert torch.equal(copy.batch(torch.arange(16))[0], train_set.batch(torch.arange(16))[0])


def test_a_folder_without_index_or_with_a_bad_one_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"index.json cannot be read .*write_shards"):
        load_shards(training(tmp_path / "empty", tmp_path))
    with pytest.raises(DataError, match="is not a shard index"):
        parse_index(json.dumps({"format": "other"}), "x/index.json")
    with pytest.raises(DataError, match="no file name in the folder"):
        parse_index(json.dumps({"format": "disttrain-shards", "version": 1,
                                "description": {"input_shape": [1], "num_classes": 2},
                                "train": [{"file": "../a.npz", "num_samples": 1}],
                                "test": [{"file": "b.npz", "num_samples": 1}]}), "x/index.json")


def test_a_shard_with_a_pickled_object_or_without_its_array_is_refused(tmp_path):
    write_shards(tmp_path / "set", arrays(16), arrays(8), samples_per_shard=8)
    buffer = io.BytesIO()
    np.savez(buffer, x=np.array([{"code": 1}] * 8, dtype=object), y=np.zeros(8))
    (tmp_path / "set" / "train-00000.npz").write_bytes(buffer.getvalue())
    buffer = io.BytesIO()
    np.savez(buffer, z=np.zeros(8))
    (tmp_path / "set" / "train-00001.npz").write_bytes(buffer.getvalue())
    train_set, _ = load_datasets(training(tmp_path / "set", tmp_path, num_shards_ahead=0))
    with pytest.raises(DataError, match=r"shard train-00000.npz is not a readable .npz of plain arrays"):
        train_set.batch(torch.tensor([0]))
    with pytest.raises(DataError, match=r"shard train-00001.npz has no array 'x'"):
        train_set.batch(torch.tensor([8]))


def test_the_shard_keys_are_checked_together(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training: {num_shards_in_memory: 2, num_shards_ahead: 2}\n")
    with pytest.raises(ConfigError, match=r"num_shards_ahead: 2 must be less than .*in_memory \(2\)"):
        load_config(path)


def test_a_reader_of_a_local_folder_reads_in_place(tmp_path):
    write_shards(tmp_path / "set", arrays(16), arrays(8), samples_per_shard=8)
    reader = ShardReader(ShardFiles(str(tmp_path / "set"), ("train-00000.npz",), ("x", "y")),
                         str(tmp_path / "data"), True, ReaderLimits(num_ahead=0))
    assert len(reader.arrays(0)["x"]) == 8
    assert not (tmp_path / "data").exists()  # nothing copied


def test_text_written_as_shards_gives_text_files_windows(tmp_path):
    from disttrain.data.shards import write_text_shards
    from disttrain.data.text import load_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(np.random.default_rng(3).integers(32, 127, 5001).astype(np.uint8)))
    spec = write_text_shards(corpus, tmp_path / "set", seq_len=16, samples_per_shard=40)
    config = TrainingConfig(dataset=spec, data_dir=str(tmp_path / "data"), seq_len=16)
    shard_train, shard_test = load_datasets(config)
    file_train, file_test = load_text(corpus, 16)
    assert (len(shard_train), len(shard_test)) == (len(file_train), len(file_test)) == (281, 31)
    assert shard_train.description == file_train.description
    for shard_split, file_split in ((shard_train, file_train), (shard_test, file_test)):
        every = torch.arange(len(file_split))
        x, y = shard_split.batch(every)
        assert x.dtype == torch.int64 and torch.equal(x, file_split.batch(every)[0])
        assert torch.equal(y, file_split.batch(every)[1])


def test_a_copy_a_peer_removes_while_the_disk_is_counted_counts_as_gone(tmp_path, monkeypatch):
    """Two workers of one run share the cache: one removes a copy (its own bound) between
    the other's listing of a folder and its look at the file. The other counts it as gone
    and reads on (a parameter-server run on S3 shards had a worker fail there, and its
    restart redo 192 samples)."""
    files, shard_bytes, one, other = two_readers_of_one_cache(tmp_path)
    is_file = Path.is_file

    def removed_by_the_peer(path: Path) -> bool:
        listed = is_file(path)
        if listed and path.parent.name.endswith(files[1]):
            path.unlink()  # the peer's removal lands between the listing and the look
        return listed

    monkeypatch.setattr(Path, "is_file", removed_by_the_peer)
    read = one.arrays(0)  # over the bound: it counts the disk as shard 1's copy goes
    monkeypatch.undo()
    assert len(read["x"]) == 8
    assert not any((tmp_path / "data" / "cache").glob(f"*-{files[1]}/*"))
    assert cached_bytes(tmp_path) <= 3 * shard_bytes
