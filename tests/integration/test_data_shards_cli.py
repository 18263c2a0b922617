"""`shards:s3://...` against a real S3-compatible server (moto's, started here on a free
port): array shards read shard by shard, within a disk cache smaller than the data set.
A baseline run ends bit for bit where a run on the same shards in a local folder does,
and, preempted mid-epoch and resumed, where the uninterrupted one does; its shards are
read ahead by the reader's thread (its counts in the log: the steps read none themselves);
a 2-worker parameter-server run on them applies every sample once. Skipped, with the
reason, where moto's server or s3fs is missing."""

import json
import re

import pytest
from s3_runs import final_model, run_on_store, s3fs, same

from disttrain.data.datasets import digits
from disttrain.data.shards import write_shards

SHARD = 64  # samples per shard: digits' 1,437 training samples in 23 shards, its 360 test ones in 6
BATCH = 32
TRAIN = 1437
STEPS_PER_EPOCH = -(-TRAIN // BATCH)
ARGS = ["--model", "mlp", "--batch-size", str(BATCH), "--num-epochs", "2", "--num-threads", "1",
        "--seed", "7", "--optimizer", "sgd", "--learning-rate", "0.05", "--checkpoint-interval", "1000",
        "--set", "training.num_shards_in_memory=3", "--set", "training.num_shards_ahead=2"]
READER = re.compile(r"training\.dataset: (\d+) shards read ahead, (\d+) read by the steps themselves")


def write_digits(location) -> str:
    train, test = digits()
    return write_shards(location, (train.images.numpy(), train.labels.numpy()),
                        (test.images.numpy(), test.labels.numpy()), SHARD)


def shard_bytes(bucket_name: str) -> int:
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    return sum(info["size"] for info in fs.find(f"{bucket_name}/digits", detail=True).values()
               if info["name"].endswith(".npz"))


def run(cli, folder, spec, port, *extra, command="baseline", data=None):
    return run_on_store(cli, ARGS, folder, spec, port, *extra, command=command, data=data, timeout=200)


def cached_shard_bytes(data) -> int:
    return sum(p.stat().st_size for p in (data / "cache").glob("*.npz/*") if p.is_file())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_baseline_on_s3_shards_resumes_bit_identical_within_its_cache_bound(tmp_path, cli, moto_port,
                                                                               bucket):
    spec = write_digits(f"s3://{bucket}/digits")
    total = shard_bytes(bucket)
    bound = total // 4  # about 7 of the 29 shards on disk at once
    limit = ["--set", f"training.shard_cache_bytes={bound}"]
    whole = run(cli, tmp_path / "whole", spec, moto_port, *limit)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert 0 < cached_shard_bytes(tmp_path / "whole" / "data") <= bound < total
    # Each epoch's start logs what was read since the last: in epoch 0 the read-ahead thread
    # read the training shards (all 23 but those the check before the run left in memory),
    # and the steps read only the test split's 6 shards (its one evaluation batch of 1,000).
    counts = [(int(a), int(b)) for a, b in READER.findall(whole.stderr)]
    assert len(counts) >= 2, whole.stderr[-3000:]
    ahead, by_steps = counts[1]
    assert ahead >= 20 and by_steps == 6, counts

    local = write_digits(tmp_path / "digits")
    from_folder = run(cli, tmp_path / "folder", local, moto_port)
    assert from_folder.returncode == 0, from_folder.stderr[-3000:]
    assert same(final_model(tmp_path / "whole"), final_model(tmp_path / "folder"))

    cut = tmp_path / "cut"
    stopped = run(cli, cut, spec, moto_port, *limit, "--inject", "term:worker=0:step=20")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = run(cli, cut, spec, moto_port, *limit, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((cut / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 20 and summary["steps"] == 2 * STEPS_PER_EPOCH
    assert same(final_model(tmp_path / "whole"), final_model(cut))
    assert cached_shard_bytes(cut / "data") <= bound


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_parameter_server_run_on_s3_shards_applies_every_sample_once(tmp_path, cli, moto_port, bucket):
    spec = write_digits(f"s3://{bucket}/digits")
    bound = shard_bytes(bucket) // 4
    result = run(cli, tmp_path, spec, moto_port, "--workers", "2", "--heartbeat-interval", "0.2",
                 "--set", f"training.shard_cache_bytes={bound}", command="ps")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    # Nothing lost or redone; the count applied is the one the same run on the built-in
    # digits (in memory) reports: 1,438 an epoch.
    assert summary["samples_lost"] == 0 and summary["samples_redone"] == 0, summary
    assert summary["samples_applied"] == summary["samples_processed"] == 2 * 1438, summary
    logs = [log.read_text() for log in (tmp_path / "logs").glob("worker*.log")]
    assert len(logs) == 2 and all(READER.search(text) for text in logs)
    assert cached_shard_bytes(tmp_path / "data") <= bound
