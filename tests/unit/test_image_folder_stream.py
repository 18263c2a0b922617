"""`image-folder:URL` read group by group (`data.image_stream`), on fsspec's in-memory
store: the groups hold every image once with its class, the held-out fifth is the whole
folder's, the samples equal the local folder's pixels (normalised by the fixed mean and
std), the disk bound holds, and without a bound the folder is fetched whole as before."""

import uuid

import fsspec
import numpy as np
import pytest
import torch

from disttrain.config import TrainingConfig
from disttrain.data import image_stream
from disttrain.data.datasets import describe_dataset, load_datasets, shard_layout
from disttrain.data.description import DatasetDescription
from tests.unit.test_text_and_images import write_images

PER_CLASS = 50  # 150 images: 30 held out, 120 trained on (groups of 64 and 56)


@pytest.fixture
def folder_url(tmp_path):
    local = tmp_path / "original" / "pets"
    write_images(local, classes=("cat", "dog", "owl"), per_class=PER_CLASS)
    location = f"memory://stream-{uuid.uuid4().hex[:8]}/pets"
    fsspec.filesystem("memory").put(str(local), location, recursive=True)
    yield location, local
    fsspec.filesystem("memory").rm(location.rsplit("/", 1)[0], recursive=True)


def cached_bytes(data) -> int:
    return sum(p.stat().st_size for p in (data / "cache").glob("*/*") if p.is_file())


@pytest.mark.timeout(120)
def test_groups_hold_every_image_once_as_the_local_folder_reads_it(tmp_path, folder_url):
    url, local = folder_url
    total = sum(p.stat().st_size for p in local.rglob("*.png"))
    bound = total // 3
    config = TrainingConfig(dataset=f"image-folder:{url}", data_dir=str(tmp_path / "data"),
                            shard_cache_bytes=bound, num_shards_ahead=0)
    assert image_stream.is_streamed(config)
    assert describe_dataset(config) == DatasetDescription.classification((3, 4, 6), 3)
    train, test = load_datasets(config)
    assert train.shard_sizes == (64, 56) and test.shard_sizes == (30,)
    assert shard_layout(config).shard_sizes == (64, 56)
    x, y = train.batch(torch.arange(len(train)))
    test_x, test_y = test.batch(torch.arange(len(test)))
    # The same images, each once: the local folder's pixels, normalised by the fixed 0.5.
    from_folder, held_out = load_datasets(TrainingConfig(dataset=f"image-folder:{local}"))
    assert sorted(y.tolist() + test_y.tolist()) == sorted([0, 1, 2] * PER_CLASS)
    assert sorted(test_y.tolist()) == sorted(held_out.labels.tolist())  # the same held-out fifth
    pixels = torch.cat([x, test_x]) * image_stream.STD + image_stream.MEAN
    opened = [image_stream._image_module().open(p).convert("RGB") for p in sorted(local.rglob("*.png"))]
    local_pixels = torch.stack([torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)
                                for image in opened])
    as_keys = sorted(tuple(t.flatten().round(decimals=4).tolist()) for t in pixels)
    assert as_keys == sorted(tuple(t.flatten().round(decimals=4).tolist()) for t in local_pixels)
    # The held-out group (30 images) was read last: the bound removed training groups for it.
    assert 0 < cached_bytes(tmp_path / "data") <= bound
    assert len(from_folder) == len(train)
    train.reader.close()


@pytest.mark.timeout(60)
def test_without_a_disk_bound_the_folder_is_fetched_whole(tmp_path, folder_url):
    url, _ = folder_url
    config = TrainingConfig(dataset=f"image-folder:{url}", data_dir=str(tmp_path / "data"))
    assert not image_stream.is_streamed(config)
    assert shard_layout(config) is None
    local = TrainingConfig(dataset="image-folder:/some/dir", shard_cache_bytes=1000)
    assert not image_stream.is_streamed(local)
