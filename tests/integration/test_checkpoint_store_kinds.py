"""Each kind of checkpoint store, written, read back and resumed from by each strategy that
can use it: `file://` under folders that do not exist yet (the baseline, the parameter
server and DDP, real processes, each stopped or killed mid-run and resumed); `memory://`
within the one process of a baseline run, and refused with one line (exit 2) by the
strategies whose processes are separate. `s3://` is `test_checkpoint_store_cli.py`'s,
a full local disk `test_checkpoint_store_full_disk.py`'s."""

import json
import uuid

import fsspec
import pytest

from disttrain.config import load_config
from disttrain.core import checkpoint as ckpt
from disttrain.strategies.baseline import STRATEGY as BASELINE
from disttrain.training.options import RunOptions

SMALL = ["--dataset", "digits", "--max-train-samples", "512", "--max-test-samples", "64", "--batch-size",
         "32", "--num-threads", "1", "--seed", "3"]


def steps_in(url):
    return [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(url)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_baseline_run_on_a_new_file_url_folder_stops_and_resumes(tmp_path, cli):
    """The issue's bug: `--checkpoint-dir file:///a/new/folder` ended the run with a
    FileNotFoundError traceback at its first checkpoint."""
    url = f"file://{tmp_path}/a/new/folder"
    args = ["baseline", *SMALL, "--num-epochs", "2", "--checkpoint-interval", "5", "--checkpoint-dir", url,
            "--log-dir", tmp_path / "logs", "--summary-json", tmp_path / "summary.json"]
    killed = cli(*args, "--inject", "kill:worker=0:step=12", timeout=120)
    assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr[-3000:]
    assert steps_in(url) == [5, 10]
    resumed = cli(*args, "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10 and summary["steps"] == 32
    assert ckpt.load_checkpoint(f"{url}/baseline_final.pt")["model"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "a" / "new" / "folder").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_parameter_server_run_on_a_new_file_url_folder_restarts_a_worker_from_it(tmp_path, cli):
    """Worker 1 killed at step 12 is restarted from its own checkpoint and key in the
    `file://` folder (made by the run), and the run finishes with every sample applied once."""
    url, logs = f"file://{tmp_path}/a/new/folder", tmp_path / "logs"
    result = cli("ps", *SMALL, "--model", "mlp", "--workers", "2", "--num-epochs", "2",
                 "--checkpoint-interval", "5", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "3",
                 "--checkpoint-dir", url, "--log-dir", logs, "--inject", "kill:worker=1:step=12", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 2 * 512
    assert "resumed from" in (logs / "worker1.log").read_text()  # the restart read its checkpoint back
    # A worker's checkpoints count its steps, a shard's its versions (the redone steps too).
    for sub, newest in (("server0", summary["steps"]), ("worker0", 16), ("worker1", 16)):
        folder = f"{url}/{sub}"
        assert steps_in(folder)[-1] == newest and ckpt.load_checkpoint(ckpt.latest_checkpoint(folder))
    assert (tmp_path / "a" / "new" / "folder" / "worker1" / "worker.key").stat().st_mode & 0o777 == 0o600
    assert ckpt.load_checkpoint(summary["final_model"])["model"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.extended  # a file URL folder: the baseline's and the parameter server's tests
def test_a_ddp_run_on_a_new_file_url_folder_stops_and_resumes(tmp_path, cli):
    url, logs = f"file://{tmp_path}/a/new/folder", tmp_path / "logs"
    args = ["ddp", *SMALL, "--world-size", "2", "--num-epochs", "2", "--checkpoint-interval", "3",
            "--checkpoint-dir", url, "--log-dir", logs]
    killed = cli(*args, "--inject", "kill:rank=1:step=5", timeout=120)
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert steps_in(url) == [3]
    resumed = cli(*args, "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 16
    assert ckpt.load_checkpoint(f"{url}/ddp_final.pt")["model"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_memory_store_serves_a_baseline_run_within_its_process(tmp_path):
    """`memory://` lives as long as the process: a baseline run trained in this one writes
    there, and a second run of the same process resumes from it and trains on."""
    url = f"memory://disttrain-kinds-{uuid.uuid4().hex}/run"

    def run(num_epochs, resume):
        config = load_config(flags={"training.dataset": "digits", "training.max_train_samples": 512,
                                    "training.max_test_samples": 64, "training.batch_size": 32,
                                    "training.num_epochs": num_epochs, "training.checkpoint_interval": 5,
                                    "system.num_threads": 1, "system.checkpoint_dir": url,
                                    "system.log_dir": str(tmp_path / "logs")})
        return BASELINE.run(config.run_by("baseline"), RunOptions(resume=resume))

    try:
        first = run(1, resume=False)
        assert first.steps == 16 and steps_in(url) == [10, 15, 16]
        second = run(2, resume=True)
        assert second.extra["resumed_from_step"] == 16 and second.steps == 32
        assert steps_in(url) == [25, 30, 32]
        assert ckpt.load_checkpoint(f"{url}/baseline_final.pt")["model"]
    finally:
        fsspec.filesystem("memory").rm(url.split("://", 1)[1].split("/", 1)[0], recursive=True)


@pytest.mark.slow  # a process of the command line each
@pytest.mark.parametrize("command", ["ps", "ddp"])
def test_a_memory_store_is_refused_by_runs_of_separate_processes(tmp_path, cli, command):
    result = cli(command, *SMALL, "--checkpoint-dir", "memory://nowhere/run", "--log-dir",
                 tmp_path / "logs", timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: system.checkpoint_dir: 'memory://nowhere/run' lives in one process's memory, and a "
        f"{command} run trains in processes of its own (restarted ones too) that cannot see it; use a local "
        "folder, file:// or a store every process reaches (s3://...)")
    assert not list((tmp_path / "logs").glob("*.log"))  # no process was started
