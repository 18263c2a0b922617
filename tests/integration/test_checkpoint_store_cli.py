"""`--checkpoint-dir s3://...` against a real S3-compatible server (moto's, started here on a
free port): checkpoints and the final model go to the bucket, `--resume` goes on from the
newest complete one, and an upload cut mid-request (or whose server is killed mid-request)
is never read as a checkpoint; for the baseline, the parameter server (its shards' and
workers' checkpoints, a worker's key) and DDP (rank 0's checkpoints, read back by every
rank). The store cut mid-run (a proxy between the runs and the server): an outage that
heals within the retry window costs nothing; one that does not stops the run with one
line (exit code 74), the launcher's last, naming the store, the error, the newest
complete checkpoint and `--resume`, and that checkpoint resumes. A bucket that does not
exist, or no credentials, is refused before the run (exit 2). Skipped, with the reason,
where moto's server or s3fs is missing."""

import json
import re
import uuid

import pytest
from s3_runs import endpoint_env, new_bucket, point_at
from s3_server import CuttingProxy, replay, start_moto, stop_moto

from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store

FAST = ["--dataset", "digits", "--batch-size", "64", "--num-epochs", "1", "--num-threads", "1",
        "--checkpoint-interval", "5", "--optimizer", "sgd", "--learning-rate", "0.05"]
STEPS = 23  # digits: 1438 training samples in batches of 64


# A short retry window for runs whose store stays down (the default is a minute).
SHORT_WINDOW = ["--set", "system.checkpoint_retry_s=1"]
# What the process was doing when its window ran out: writing a checkpoint, or listing and
# pruning the folder right after writing one (which comes first depends on where the cut falls).
STORE_LINE = (r"checkpoint store s3://{bucket}/run{sub}: (?:(?:writing|removing) checkpoint_step\d{{8}}\.pt"
              r"(?:\.sha256)?|listing the folder) "
              r"failed for \d+s \(\d+ attempt\(s\), system\.checkpoint_retry_s=1\): [^;]+; the newest "
              r"complete checkpoint there is step {step}; once the store works again, run the same command "
              r"with --resume")


def last_line(result):
    return result.stderr.strip().splitlines()[-1]


def baseline(cli, tmp_path, url, port, *extra):
    return cli("baseline", *FAST, "--checkpoint-dir", url, "--log-dir", tmp_path / "logs",
               "--summary-json", tmp_path / "summary.json", *extra, env=endpoint_env(port), timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_checkpoints_to_s3_and_resumes_from_there(tmp_path, cli, moto_port, bucket):
    url = f"s3://{bucket}/run"
    first = baseline(cli, tmp_path, url, moto_port)
    assert first.returncode == 0, first.stderr
    found = ckpt.list_checkpoints(url)
    assert [ckpt.checkpoint_step(p) for p in found] == [15, 20, 23]  # the newest 3, the last at the end
    assert ckpt.load_checkpoint(f"{url}/baseline_final.pt")["model"]
    resumed = baseline(cli, tmp_path, url, moto_port, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == STEPS and summary["steps"] == STEPS


def cut_at(part):
    """What a cut or a kill lands in: step 10's checkpoint data (4 KiB into it), or its sidecar
    (before its first byte, the data whole)."""
    name = rb"checkpoint_step00000010\.pt"
    if part == "data":
        return rb"PUT /[^ ]*" + name + rb"[ ?]", 4096
    return rb"PUT /[^ ]*" + name + rb"\.sha256[ ?]", 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_store_cut_for_good_stops_the_run_with_one_line(tmp_path, cli, moto_port, bucket):
    """The connection is cut while step 10's checkpoint goes up, and the store stays
    unreachable (the server is up): the run retries through its window, then stops with
    exit code 74 and one line as its last; what the bucket holds of step 10 is no
    checkpoint, and `--resume` goes on from step 5."""
    url = f"s3://{bucket}/run"
    proxy = CuttingProxy(moto_port, *cut_at("data"))
    try:
        failed = baseline(cli, tmp_path, url, proxy.port, *SHORT_WINDOW)
    finally:
        proxy.close()
    assert proxy.cut.is_set(), failed.stderr[-2000:]
    assert failed.returncode == 74, failed.stderr[-2000:]
    assert re.fullmatch("error: " + STORE_LINE.format(bucket=bucket, sub="", step=5), last_line(failed)), \
        failed.stderr[-2000:]
    assert "checkpoint_step00000010.pt failed" in last_line(failed) and "Traceback" not in failed.stderr
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)] == [5]
    resumed = baseline(cli, tmp_path, url, moto_port, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from_step"] == 5
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)] == [15, 20, 23]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_store_outage_that_heals_within_the_window_costs_nothing(tmp_path, cli, moto_port, bucket):
    """Step 10's upload is cut and the store refuses the next twelve connections, then
    comes back: the run retries, finishes, and every checkpoint it wrote is complete. (s3fs
    tries a call at most five times itself, so its own retries cannot ride out the outage:
    the run's must.)"""
    url = f"s3://{bucket}/run"
    proxy = CuttingProxy(moto_port, *cut_at("data"), heal_after=12)
    try:
        healed = baseline(cli, tmp_path, url, proxy.port, "--set", "system.checkpoint_keep=10")
    finally:
        proxy.close()
    assert proxy.cut.is_set() and proxy.healed.is_set(), healed.stderr[-2000:]
    assert healed.returncode == 0, healed.stderr[-2000:]
    assert "writing checkpoint_step00000010.pt failed (" in healed.stderr  # the cut hit, and was retried
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)] == [5, 10, 15, 20, 23]
    assert all(ckpt.load_checkpoint(p)["position"]["step"] == ckpt.checkpoint_step(p)
               for p in ckpt.list_checkpoints(url))
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == STEPS


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("part", ["data", pytest.param("sidecar", marks=pytest.mark.extended)])
def test_a_server_killed_mid_upload_keeps_no_torn_checkpoint(tmp_path, cli, monkeypatch, part):
    """The S3 server itself is SIGKILLed while step 10's checkpoint goes up: with its data
    half received, or with the data whole and the sidecar not begun. Started again on its
    journal (what it had received whole before the kill), it holds step 5's checkpoint and
    nothing of step 10 that reads as one; `--resume` against it goes on from step 5 and
    finishes the run."""
    journal = tmp_path / "s3-journal.jsonl"
    try:
        server, port = start_moto(journal)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no S3-compatible server could start: {e}")
    point_at(port, monkeypatch)
    url = f"s3://{new_bucket(port)}/run"
    proxy = CuttingProxy(port, *cut_at(part), on_cut=server.kill)
    try:
        failed = baseline(cli, tmp_path, url, proxy.port, *SHORT_WINDOW)
    finally:
        proxy.close()
        server.wait(timeout=30)
    assert proxy.cut.is_set() and server.returncode == -9, failed.stderr[-2000:]
    assert failed.returncode == 74, failed.stderr[-2000:]
    assert "checkpoint_step00000010.pt" in last_line(failed), failed.stderr[-2000:]

    restarted, port = start_moto(journal)
    try:
        replay(port)
        point_at(port, monkeypatch)
        # Killed before the sidecar, step 10's data is whole on the store: only its sidecar's
        # absence keeps it from being read.
        assert object_store.exists(f"{url}/checkpoint_step00000010.pt") == (part == "sidecar")
        assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)] == [5]
        resumed = baseline(cli, tmp_path, url, port, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads((tmp_path / "summary.json").read_text())["resumed_from_step"] == 5
        assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)] == [15, 20, 23]
    finally:
        stop_moto(restarted)


@pytest.mark.slow  # an S3 server and the command line as processes
def test_a_bucket_that_does_not_exist_is_refused_before_the_run(tmp_path, cli, moto_port):
    """No such bucket: one line naming it, exit code 2, before any training."""
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    result = baseline(cli, tmp_path, url, moto_port)
    assert result.returncode == 2, result.stderr[-2000:]
    assert last_line(result) == (
        f"error: system.checkpoint_dir: cannot write checkpoints to {url} (FileNotFoundError: The specified "
        "bucket does not exist); check the bucket or folder name, that it is writable with the credentials "
        "given and has space, or choose another --checkpoint-dir"), result.stderr[-2000:]
    assert not (tmp_path / "logs").exists()  # refused before the run began


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ps", "ddp"])
def test_a_multi_process_run_without_credentials_is_refused_before_any_process(tmp_path, cli, moto_port,
                                                                                 command):
    """No credentials anywhere: the launcher refuses with one line, exit code 2, before it
    starts a process."""
    env = {"FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": "",  # empty: none
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_EC2_METADATA_DISABLED": "true"}
    url = f"s3://ckpt-{uuid.uuid4().hex[:12]}/run"
    result = cli(command, "--dataset", "digits", "--checkpoint-dir", url, "--log-dir", tmp_path / "logs",
                 env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert last_line(result).startswith(f"error: system.checkpoint_dir: cannot write checkpoints to {url} "
                                        "(NoCredentialsError: Unable to locate credentials); "), \
        result.stderr[-2000:]
    assert not list((tmp_path / "logs").glob("*.log"))  # no process was started


# Parameter server: 2 workers x 10 steps an epoch, 2 epochs, a checkpoint every 5 steps.
PS_TRAIN, PS_EPOCHS = 640, 2
PS_ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--batch-size", "32",
           "--max-train-samples", str(PS_TRAIN), "--max-test-samples", "200", "--num-epochs", str(PS_EPOCHS),
           "--checkpoint-interval", "5", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
           "--seed", "3"]


def newest_step(url):
    found = ckpt.list_checkpoints(url)
    return ckpt.checkpoint_step(found[-1]) if found else -1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_parameter_server_run_checkpoints_to_s3_and_resumes_from_there(tmp_path, cli, moto_port, bucket):
    """Worker 1 killed at step 12 and not restarted stops the run; everything it needs to go
    on is in the bucket, and `--resume` goes on from there: every sample applied once, from
    the step worker 0 had stored. Run from an empty folder, which stays empty: nothing went
    to a local path."""
    url, cwd = f"s3://{bucket}/run", tmp_path / "cwd"
    cwd.mkdir()
    folders = ["--checkpoint-dir", url, "--log-dir", tmp_path / "logs"]
    stopped = cli("ps", *PS_ARGS, *folders, "--inject", "kill:worker=1:step=12", "--max-restarts", "0",
                  "--set", "coordinator.reassign_after=null",  # no reassignment: the run stops
                  env=endpoint_env(moto_port), cwd=cwd, timeout=180)
    assert stopped.returncode == 1 and "max_restarts=0" in stopped.stderr, stopped.stderr[-3000:]
    stored = newest_step(f"{url}/worker0")
    assert stored >= 5  # 5 or 10: the kill was at step 12 of worker 1, which holds worker 0 in sync
    assert newest_step(f"{url}/worker1") in (5, 10)  # step 10's upload may have been cut by the kill
    assert ckpt.list_checkpoints(f"{url}/server0")  # the shard saved itself at versions 5, 10, ...
    assert len(object_store.read_bytes(f"{url}/worker1/worker.key")) >= 32

    resumed = cli("ps", *PS_ARGS, *folders, "--resume", env=endpoint_env(moto_port), cwd=cwd, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == stored
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == PS_EPOCHS * PS_TRAIN
    assert summary["final_model"] == f"{url}/parameter_server_final.pt"
    assert ckpt.load_checkpoint(summary["final_model"])["model"]
    assert newest_step(f"{url}/worker0") == PS_EPOCHS * PS_TRAIN // 2 // 32
    assert list(cwd.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.extended  # an outage ridden out: the baseline's test above
def test_a_parameter_server_run_rides_out_a_store_outage(tmp_path, cli, moto_port, bucket):
    """Shard 0's upload of a checkpoint from version 10 on is cut and the store refuses the
    next twenty connections (of any process), then comes back: the processes retry, the
    shard's writer in the background while training goes on, and the run finishes with
    every sample applied once."""
    url, logs = f"s3://{bucket}/run", tmp_path / "logs"
    proxy = CuttingProxy(moto_port, rb"PUT /[^ ]*server0/checkpoint_step000000(1\d|20)\.pt[ ?]", 4096,
                         heal_after=20)
    try:
        run = cli("ps", *PS_ARGS, "--checkpoint-dir", url, "--log-dir", logs, env=endpoint_env(proxy.port),
                  timeout=240)
    finally:
        proxy.close()
    assert proxy.cut.is_set() and proxy.healed.is_set(), run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    # Which request met the outage, and at which layer it was retried, depends on the
    # interleaving: aiohttp sends a request again once when a reused connection closes, and
    # the rest reach `store_retry` (its part: tests/unit/test_checkpoint_store_retry.py). The
    # outage was real (20 connections refused, an upload cut) and the run rode it out:
    # nothing lost, and the shard's newest checkpoint (from the cut range) complete.
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == PS_EPOCHS * PS_TRAIN
    assert ckpt.load_checkpoint(summary["final_model"])["model"]
    steps = PS_EPOCHS * PS_TRAIN // 2 // 32
    for sub in ("server0", "worker0", "worker1"):  # every newest checkpoint complete and readable
        newest = ckpt.latest_checkpoint(f"{url}/{sub}")
        assert ckpt.checkpoint_step(newest) == steps and ckpt.load_checkpoint(newest)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.extended  # a store failed for good: the baseline's and DDP's tests
def test_a_parameter_server_run_whose_store_fails_for_good_stops_with_that_line(tmp_path, cli, moto_port,
                                                                                  bucket):
    """The store is cut at worker 1's checkpoint of step 10 and stays down: the first
    process whose retry window runs out stops the run; the launcher's last line is that
    process's own, naming it, with the newest complete checkpoint as the bucket holds it,
    and exit code 74 (not a crash to restart). `--resume` against the store once it is
    back goes on from there and finishes with every sample applied once: the shard from
    its newest checkpoint, worker 0 (which writes the summary) from its newest one whose
    steps the shard holds (sync: a shard's version counts the steps it applied), or from
    the beginning with none (the shard's own newest may be older than the workers')."""
    url, logs = f"s3://{bucket}/run", tmp_path / "logs"
    folders = ["--checkpoint-dir", url, "--log-dir", logs]
    proxy = CuttingProxy(moto_port, rb"PUT /[^ ]*worker1/checkpoint_step00000010\.pt[ ?]", 4096)
    # Every process loses the store at once and stops; they take a few seconds to exit, which a
    # 1.5 s heartbeat timeout would take for hangs (killed, they would not exit with their code).
    patient = ["--heartbeat-timeout", "10"]
    try:
        stopped = cli("ps", *PS_ARGS, *patient, *folders, *SHORT_WINDOW, env=endpoint_env(proxy.port),
                      timeout=240)
    finally:
        proxy.close()
    assert proxy.cut.is_set(), stopped.stderr[-3000:]
    assert stopped.returncode == 74, stopped.stderr[-3000:]
    pattern = r"error: (?P<process>worker\d|server\d): " + STORE_LINE.format(
        bucket=bucket, sub="/(?P=process)", step=r"(?P<step>\d+)")
    line = re.fullmatch(pattern, last_line(stopped))
    assert line is not None, stopped.stderr[-3000:]
    assert int(line["step"]) == newest_step(f"{url}/{line['process']}")  # what the bucket really holds
    assert "Traceback" not in stopped.stderr

    shard_version = newest_step(f"{url}/server0")
    held = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(f"{url}/worker0")]
    resumed = cli("ps", *PS_ARGS, *folders, "--resume", env=endpoint_env(moto_port), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == PS_EPOCHS * PS_TRAIN
    assert summary["resumed_from_step"] == max((s for s in held if s <= shard_version), default=None), \
        (shard_version, held)


# DDP: 2 ranks x 8 steps an epoch, 2 epochs, a checkpoint every 3 steps.
DDP_ARGS = ["--world-size", "2", "--dataset", "digits", "--max-train-samples", "512", "--max-test-samples",
            "64", "--num-epochs", "2", "--batch-size", "32", "--seed", "3", "--checkpoint-interval", "3"]
DDP_STEPS = 2 * 512 // 2 // 32


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_ddp_run_checkpoints_to_s3_and_resumes_from_there(tmp_path, cli, moto_port, bucket):
    """Rank 1 killed at step 5 stops the group; rank 0's step-3 checkpoint is in the bucket
    (its saves are collectives: done before step 4 began), and `--resume` has both ranks
    read it from there and finish the run."""
    url, cwd = f"s3://{bucket}/run", tmp_path / "cwd"
    cwd.mkdir()
    folders = ["--checkpoint-dir", url, "--log-dir", tmp_path / "logs"]
    killed = cli("ddp", *DDP_ARGS, *folders, "--inject", "kill:rank=1:step=5", env=endpoint_env(moto_port),
                 cwd=cwd, timeout=120)
    assert killed.returncode != 0 and "injected fault: kill at step 5" in killed.stderr, killed.stderr[-3000:]
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)] == [3]
    assert len(ckpt.load_checkpoint(f"{url}/{ckpt.checkpoint_name(3)}")["rng"]) == 2  # every rank's own

    resumed = cli("ddp", *DDP_ARGS, *folders, "--resume", env=endpoint_env(moto_port), cwd=cwd, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["steps"] == DDP_STEPS
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)][-1] == DDP_STEPS
    assert ckpt.load_checkpoint(f"{url}/ddp_final.pt")["model"]
    assert list(cwd.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recovery", ["restart", pytest.param("live", marks=pytest.mark.extended)])
def test_a_ddp_run_whose_store_fails_for_good_stops_with_rank_0s_line(tmp_path, cli, moto_port, bucket,
                                                                       recovery):
    """The store is cut at rank 0's first checkpoint from step 6 on (a live rank writes in
    the background, and may skip one) and stays down: rank 0 stops with the store's line,
    which the launcher surfaces as its last (not "lost contact" from rank 1), exit code 74,
    naming the newest checkpoint the bucket holds; `--resume` finishes the run from there."""
    url, logs = f"s3://{bucket}/run", tmp_path / "logs"
    folders = ["--checkpoint-dir", url, "--log-dir", logs, "--ddp-recovery", recovery]
    proxy = CuttingProxy(moto_port, rb"PUT /[^ ]*checkpoint_step000000(0[6-9]|1\d)\.pt[ ?]", 4096)
    try:
        stopped = cli("ddp", *DDP_ARGS, *folders, *SHORT_WINDOW, env=endpoint_env(proxy.port), timeout=180)
    finally:
        proxy.close()
    assert proxy.cut.is_set(), stopped.stderr[-3000:]
    assert stopped.returncode == 74, stopped.stderr[-3000:]
    line = re.fullmatch("error: rank 0: " + STORE_LINE.format(bucket=bucket, sub="", step=r"(?P<step>\d+)"),
                        last_line(stopped))
    assert line is not None, stopped.stderr[-3000:]
    assert int(line["step"]) == newest_step(url) >= 3  # what the bucket really holds
    resumed = cli("ddp", *DDP_ARGS, *folders, "--resume", env=endpoint_env(moto_port), timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["steps"] == DDP_STEPS
    if recovery == "restart":
        assert summary["resumed_from_step"] == int(line["step"])
