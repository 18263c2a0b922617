"""`text:s3://...` and `image-folder:s3://...` against a real S3-compatible server (moto's,
started here on a free port): a baseline run reads the object through its cached copy and
ends bit for bit where a run on the same text as a local file does; preempted mid-epoch and
resumed, it ends there too; a second run on the same data folder fetches nothing, and a
changed object is fetched again; a 2-worker parameter-server run applies every sample once;
a missing object is one line, exit code 2, before the run; an image folder in the bucket
trains as the same local folder does. Skipped, with the reason, where moto's server or s3fs
is missing."""

import json
import random
import re

import pytest
from s3_runs import endpoint_env, final_model, run_on_store, s3fs, same

from tests.unit.test_text_and_images import write_images

TINY_GPT = "training.model_args={n_layer: 1, n_head: 2, n_embd: 16}"
SEQ_LEN, BATCH = 16, 16
TRAIN = 224  # of the 230 training windows of TEXT (256 windows of 16, the last tenth held out)
ARGS = ["--model", "gpt_small", "--set", TINY_GPT, "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH),
        "--max-train-samples", str(TRAIN), "--max-test-samples", "16", "--num-epochs", "2",
        "--num-threads", "1", "--checkpoint-interval", "1000", "--seed", "7", "--optimizer", "sgd",
        "--learning-rate", "0.05"]
STEPS_PER_EPOCH = TRAIN // BATCH
FETCHED = re.compile(r"training\.dataset: fetched (\S+) \((\d+) bytes\) into ")


def corpus(seed: int) -> bytes:
    """4,097 bytes of words: 256 windows of 16 tokens and the one byte the last target needs."""
    words = ["store", "cache", "worker", "shard", "step", "ledger", "block", "bucket", "epoch", "rank"]
    rng = random.Random(seed)
    text = ""
    while len(text) < 4097:
        text += rng.choice(words) + rng.choice([" ", " ", ", ", ".\n"])
    return text[:4097].encode()


def put(url: str, data: bytes) -> None:
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(url, data)


def run(cli, folder, dataset, port, *extra, command="baseline"):
    return run_on_store(cli, ARGS, folder, dataset, port, *extra, command=command, timeout=150)


def fetches(result) -> list[tuple[str, int]]:
    return [(url, int(size)) for url, size in FETCHED.findall(result.stderr)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_baseline_on_s3_text_resumes_bit_identical_and_matches_the_local_file(tmp_path, cli, moto_port,
                                                                                 bucket):
    url, text = f"s3://{bucket}/corpus.txt", corpus(1)
    put(url, text)
    whole = run(cli, tmp_path / "whole", f"text:{url}", moto_port)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert fetches(whole) == [(url, len(text))]  # fetched once: the step before the run and the run share it

    local = tmp_path / "corpus.txt"
    local.write_bytes(text)
    from_file = run(cli, tmp_path / "file", f"text:{local}", moto_port)
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    assert same(final_model(tmp_path / "whole"), final_model(tmp_path / "file"))

    # Preempted mid-epoch, on the first run's data folder: its copy is read, nothing fetched.
    cut = tmp_path / "cut"
    shared = ["--data-dir", tmp_path / "whole" / "data"]
    stopped = run(cli, cut, f"text:{url}", moto_port, *shared, "--inject", "term:worker=0:step=5")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert fetches(stopped) == [] and f"training.dataset: {url} read from its cached copy" in stopped.stderr
    resumed = run(cli, cut, f"text:{url}", moto_port, *shared, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert fetches(resumed) == []
    summary = json.loads((cut / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5 and summary["steps"] == 2 * STEPS_PER_EPOCH
    assert same(final_model(tmp_path / "whole"), final_model(cut))

    # The object replaced: the next run on that data folder notices and fetches it again.
    put(url, corpus(2))
    changed = run(cli, tmp_path / "changed", f"text:{url}", moto_port, *shared, "--num-epochs", "1")
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert fetches(changed) == [(url, len(corpus(2)))]
    assert f"training.dataset: {url} changed in the store since it was cached; fetching it again" in \
        changed.stderr
    copies = list((tmp_path / "whole" / "data" / "cache").glob("*/*"))
    assert [p.read_bytes() for p in copies] == [corpus(2)]  # the old version is gone


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.extended  # a parameter server on a store: test_data_shards_cli
def test_a_parameter_server_run_on_s3_text_applies_every_sample_once(tmp_path, cli, moto_port, bucket):
    url = f"s3://{bucket}/corpus.txt"
    put(url, corpus(3))
    result = run(cli, tmp_path, f"text:{url}", moto_port, "--workers", "2", "--heartbeat-interval", "0.2",
                 command="ps")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 2 * TRAIN
    # The launcher fetched it (its step before the run); each worker read that copy.
    logs = {log.name: log.read_text() for log in (tmp_path / "logs").glob("*.log")}
    workers = [text for name, text in logs.items() if name.startswith("worker")]
    assert [url for url, _ in fetches(result)] == [url], sorted(logs)
    assert len(workers) == 2 and all(f"training.dataset: {url} read from its cached copy" in text
                                     and not FETCHED.search(text) for text in workers), sorted(logs)


@pytest.mark.slow  # moto's server and a command: about 11 s on two busy cores
@pytest.mark.timeout(120)
def test_a_missing_object_is_one_line_before_the_run(tmp_path, cli, moto_port, bucket):
    url = f"s3://{bucket}/absent.txt"
    result = run(cli, tmp_path, f"text:{url}", moto_port)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: training.dataset: {url} cannot be read (FileNotFoundError"), last
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()  # refused before the run began


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_baseline_on_an_s3_image_folder_matches_the_local_folder(tmp_path, cli, moto_port, bucket):
    local = tmp_path / "pets"
    write_images(local, per_class=8)
    url = f"s3://{bucket}/pets"
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(local), f"{bucket}/pets", recursive=True)
    args = ["--model", "mlp", "--batch-size", "4", "--num-epochs", "2", "--num-threads", "1", "--seed", "7",
            "--optimizer", "sgd", "--learning-rate", "0.05", "--checkpoint-interval", "1000"]
    results = {}
    for kind, spec in (("store", f"image-folder:{url}"), ("local", f"image-folder:{local}")):
        folder = tmp_path / kind
        results[kind] = cli("baseline", *args, "--dataset", spec, "--data-dir", folder / "data", "--log-dir",
                            folder / "logs", "--checkpoint-dir", folder / "ckpt", env=endpoint_env(moto_port),
                            timeout=150)
        assert results[kind].returncode == 0, results[kind].stderr[-3000:]
    assert same(final_model(tmp_path / "store"), final_model(tmp_path / "local"))
    num_bytes = sum(p.stat().st_size for p in local.rglob("*.png"))
    assert f"training.dataset: fetched {url} (16 objects, {num_bytes} bytes) into " in results["store"].stderr
    assert len(re.findall("training.dataset: fetched", results["store"].stderr)) == 1
