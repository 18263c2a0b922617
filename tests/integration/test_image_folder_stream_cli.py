"""`image-folder:s3://...` with `training.shard_cache_bytes` against a real S3-compatible
server (moto's, started here on a free port): the folder is listed once and its images are
read group by group (the shards of the sampler's order), within a disk cache smaller than
the folder. A baseline run keeps its cached images within the bound and fetches the
folder's images lazily (read ahead by the reader's thread); preempted mid-epoch and resumed,
it ends bit for bit where the uninterrupted run does; a 2-worker parameter-server run on
it applies every sample once. Skipped, with the reason, where moto's
server or s3fs is missing."""

import json
import re

import pytest
from s3_runs import final_model, run_on_store, s3fs, same

from disttrain.data import image_stream
from tests.unit.test_text_and_images import write_images

PER_CLASS = 200  # 400 images: 80 held out (1 group of 64 and one of 16), 320 trained on (5 groups)
TRAIN = 320
BATCH = 16
STEPS_PER_EPOCH = TRAIN // BATCH
ARGS = ["--model", "mlp", "--batch-size", str(BATCH), "--num-epochs", "2", "--num-threads", "1",
        "--seed", "7", "--optimizer", "sgd", "--learning-rate", "0.05", "--checkpoint-interval", "1000",
        "--set", "training.num_shards_in_memory=3", "--set", "training.num_shards_ahead=1"]
READER = re.compile(r"training\.dataset: (\d+) shards read ahead, (\d+) read by the steps themselves")


def run(cli, folder, spec, port, *extra, command="baseline"):
    return run_on_store(cli, ARGS, folder, spec, port, *extra, command=command, timeout=250)


def put_images(tmp_path, bucket_name: str) -> int:
    """The images written into the bucket's `pets` folder; their bytes."""
    assert image_stream.IMAGES_PER_SHARD == 64  # the group counts above
    local = tmp_path / "pets"
    write_images(local, per_class=PER_CLASS)
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(local), f"{bucket_name}/pets", recursive=True)
    return sum(p.stat().st_size for p in local.rglob("*.png"))


def cached_bytes(data) -> int:
    return sum(p.stat().st_size for p in (data / "cache").glob("*/*") if p.is_file())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_s3_image_folder_streams_within_its_cache_bound_and_resumes_bit_identical(tmp_path, cli, moto_port,
                                                                                     bucket):
    total = put_images(tmp_path, bucket)
    bound = total // 2  # about 3 of the 7 groups on disk at once
    spec, limit = f"image-folder:s3://{bucket}/pets", ["--set", f"training.shard_cache_bytes={bound}"]

    whole = run(cli, tmp_path / "whole", spec, moto_port, *limit)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert 0 < cached_bytes(tmp_path / "whole" / "data") <= bound < total
    assert f"training.dataset: fetched s3://{bucket}/pets (" not in whole.stderr  # never the folder whole
    assert f"training.dataset: fetched s3://{bucket}/pets/cat/0.png (" in whole.stderr  # image by image
    # Epoch 1's start logs what epoch 0 read: the training groups read ahead by the thread.
    counts = [(int(a), int(b)) for a, b in READER.findall(whole.stderr)]
    assert counts and counts[-1][0] >= 3, (counts, whole.stderr[-3000:])

    cut = tmp_path / "cut"
    stopped = run(cli, cut, spec, moto_port, *limit, "--inject", "term:worker=0:step=27")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run(cli, cut, spec, moto_port, *limit, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((cut / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 27 and summary["steps"] == 2 * STEPS_PER_EPOCH
    assert same(final_model(tmp_path / "whole"), final_model(cut))
    assert 0 < cached_bytes(cut / "data") <= bound


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.extended  # a parameter server on a store: test_data_shards_cli
def test_a_parameter_server_run_on_an_s3_image_folder_applies_every_sample_once(tmp_path, cli, moto_port,
                                                                                bucket):
    bound = put_images(tmp_path, bucket) // 2
    result = run(cli, tmp_path, f"image-folder:s3://{bucket}/pets", moto_port, "--workers", "2",
                 "--heartbeat-interval", "0.2", "--set", f"training.shard_cache_bytes={bound}", command="ps")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_redone"] == 0, summary
    assert summary["samples_applied"] == summary["samples_processed"] == 2 * TRAIN, summary
    logs = [log.read_text() for log in (tmp_path / "logs").glob("worker*.log")]
    assert len(logs) == 2 and all(READER.search(text) for text in logs)
    assert 0 < cached_bytes(tmp_path / "data") <= bound
