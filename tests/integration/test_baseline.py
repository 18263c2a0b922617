"""The baseline from the command line: a real run, exact resume after SIGKILL, bad input."""

import json
import signal

import pytest
import torch
from conftest import run_cli
from event_files import assert_tensorboard_mirrors_jsonl

from disttrain.core import checkpoint as ckpt
from disttrain.data import ShardedSampler
from disttrain.metrics.hparams import read_hparams
from disttrain.metrics.logger import read_metrics

FAST = ["--dataset", "digits", "--batch-size", "64", "--num-epochs", "2", "--num-threads", "1",
        "--checkpoint-interval", "5", "--optimizer", "sgd", "--learning-rate", "0.05"]


def dirs(tmp_path, name):
    return ["--checkpoint-dir", tmp_path / name / "ckpt", "--log-dir", tmp_path / name / "logs"]


def final_weights(tmp_path, name):
    return ckpt.load_checkpoint(tmp_path / name / "ckpt" / "baseline_final.pt")["model"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """One uninterrupted run of 3 epochs (69 steps of 64 samples), read by the two tests
    below: (the folder, the command's result)."""
    folder = tmp_path_factory.mktemp("baseline")
    result = run_cli("baseline", *FAST, "--num-epochs", "3", *dirs(folder, "run"),
                     "--summary-json", folder / "s.json")
    return folder, result


@pytest.mark.slow  # a training run of 3 epochs as a process (the module's)
@pytest.mark.timeout(240)  # the shared run too, for the first test that reads it
def test_run_writes_metrics_events_checkpoints_and_summary(whole_run, cli):
    tmp_path, result = whole_run
    assert result.returncode == 0, result.stderr
    assert "Final Accuracy:" in result.stdout and "Throughput:" in result.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["strategy"] == "baseline" and summary["world_size"] == 1
    assert summary["final_accuracy"] > 0.8  # digits is easy; a broken loop stays near 0.1
    assert summary["steps"] == 3 * 23 and summary["samples_processed"] == 3 * 1438
    assert json.loads((tmp_path / "run" / "logs" / "summary.json").read_text()) == summary
    records = read_metrics(tmp_path / "run" / "logs" / "baseline" / "metrics.jsonl")
    train = [r for r in records if "loss/train" in r]
    assert train and {"throughput/samples_per_s", "time/compute_s", "accuracy/train"} <= set(train[0])
    assert [r["accuracy/test"] for r in records if "accuracy/test" in r][-1] == summary["final_accuracy"]
    assert list((tmp_path / "run" / "logs" / "baseline").glob("events.out.tfevents.*"))
    assert len(ckpt.list_checkpoints(tmp_path / "run" / "ckpt")) == 3  # the newest `keep`
    evaluated = cli("evaluate", "--dataset", "digits",
                    tmp_path / "run" / "ckpt" / "baseline_final.pt")
    assert f"Test Accuracy: {summary['final_accuracy'] * 100:.2f}%" in evaluated.stdout


# Warm-up then cosine decay over the run, AdamW with weight decay, clipping, bf16 autocast,
# batches loaded by worker processes: the schedule's count travels in the checkpoint, so
# the resumed run goes on along the same curve; bf16 on the CPU is as deterministic as
# float32; the loader reads ahead on a copy of the sampler, whose position stays the steps'.
FEATURES = ["--optimizer", "adamw", "--weight-decay", "0.1", "--learning-rate", "0.01",
            "--lr-schedule", "cosine", "--warmup-steps", "8", "--lr-decay-steps", "46",
            "--lr-min", "0.001", "--clip-grad-norm", "0.5", "--precision", "bf16", "--loader-workers", "2"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("features", [pytest.param([], marks=pytest.mark.extended), FEATURES],
                         ids=["constant", "schedule-adamw-clipping-bf16-loader"])
def test_sigkill_mid_epoch_then_resume_is_exact(tmp_path, cli, features):
    whole = cli("baseline", *FAST, *features, *dirs(tmp_path, "whole"))
    assert whole.returncode == 0, whole.stderr

    killed = cli("baseline", *FAST, *features, *dirs(tmp_path, "cut"), "--inject", "kill:worker=0:step=13")
    assert killed.returncode == -signal.SIGKILL
    newest = ckpt.latest_checkpoint(tmp_path / "cut" / "ckpt")
    assert newest.name == "checkpoint_step00000010.pt"

    # From the sampler: the checkpoint the resume started from sits mid-epoch, and what it
    # had consumed plus what it had left is the epoch's shard, each sample exactly once.
    state = ckpt.load_checkpoint(newest)
    sampler = ShardedSampler(state["sampler"]["num_samples"], seed=state["sampler"]["seed"])
    sampler.load_state_dict(state["sampler"])
    assert 0 < sampler.position < len(sampler)
    consumed, remaining = sampler.consumed(), sampler.remaining()
    assert len(consumed) == 10 * 64
    combined = torch.cat([consumed, remaining])
    assert torch.equal(combined, sampler.shard()) and len(combined.unique()) == len(sampler)
    if features:
        assert state["schedule"] == {"num_steps": 10}
        assert state["optimizer"]["param_groups"][0]["lr"] < 0.01  # mid-curve, not the initial rate
    resumed = cli("baseline", *FAST, *features, *dirs(tmp_path, "cut"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    if features:  # every batch of the resumed run came from the workers
        assert "loader workers: 36 batches loaded ahead, 0 in the training process" in resumed.stderr

    expected, actual = final_weights(tmp_path, "whole"), final_weights(tmp_path, "cut")
    assert all(torch.equal(expected[k], actual[k]) for k in expected)

    summary = json.loads((tmp_path / "cut" / "logs" / "summary.json").read_text())
    assert summary["steps"] == 46 and summary["resumed_from_step"] == 10
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "logs" / "baseline" / "metrics.jsonl")
             if "loss/train" in r]
    assert steps == sorted(set(steps))  # no step logged twice across the kill
    # TensorBoard shows the same records: the redone steps' once, the resume step's kept.
    assert_tensorboard_mirrors_jsonl(tmp_path / "cut" / "logs" / "baseline")


def one_line_error(result, fragment, code):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and any(fragment in line for line in errors), result.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--batch-size", "-5"], "training.batch_size: -5 must be > 0"),
    (["--set", "training.batchsize=3"], "unknown key; did you mean training.batch_size"),
    (["--set", "system.heartbeat_interval=5", "--set", "system.heartbeat_timeout=2"],
     "system.heartbeat_timeout: 2.0 must be greater than system.heartbeat_interval"),
    (["--model", "resnet"], "training.model_architecture: 'resnet' is not a registered model"),
])
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bad_config_exits_2_with_one_line(tmp_path, cli, args, fragment):
    one_line_error(cli("baseline", *FAST, *dirs(tmp_path, "bad"), *args), fragment, 2)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(60)
def test_bad_config_file(tmp_path, cli):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  batch_size: -1\nsytem: {}\n")
    result = cli("baseline", "--config", path)
    one_line_error(result, "training.batch_size: -1 must be > 0", 2)
    assert "sytem: unknown section; did you mean system?" in result.stderr


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(60)
def test_missing_data_directory(tmp_path, cli):
    result = cli("baseline", "--dataset", "mnist", "--data-dir", tmp_path / "nowhere",
                 "--set", "training.download=false", *dirs(tmp_path, "x"))
    one_line_error(result, "put the files train-images-idx3-ubyte.gz", 1)


@pytest.mark.slow  # a process of the command line
@pytest.mark.timeout(60)
def test_truncated_idx_file(tmp_path, cli, real_data_dir):
    folder = tmp_path / "data" / "mnist"
    folder.mkdir(parents=True)
    for source in (real_data_dir / "mnist").iterdir():
        data = source.read_bytes()
        (folder / source.name).write_bytes(data[:-5000] if "t10k-images" in source.name else data)
    result = cli("baseline", "--dataset", "mnist", "--data-dir", tmp_path / "data",
                 "--set", "training.download=false", *dirs(tmp_path, "x"))
    one_line_error(result, "t10k-images-idx3-ubyte.gz is a truncated or corrupt gzip", 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_corrupt_newest_checkpoint_is_named_skipped_and_never_overwritten(tmp_path, cli):
    small = [*FAST, "--max-train-samples", "640", "--max-test-samples", "200"]  # steps 5 and 10 checkpointed
    first = cli("baseline", *small, "--num-epochs", "1", "--checkpoint-interval", "5", *dirs(tmp_path, "run"))
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "run" / "ckpt"
    found = ckpt.list_checkpoints(folder)
    newest, previous = found[-1], found[-2]
    newest.write_bytes(newest.read_bytes()[:1000])
    damaged = newest.read_bytes()

    fresh = cli("baseline", *small, *dirs(tmp_path, "run"))  # without --resume: refused, nothing touched
    one_line_error(fresh, "already holds checkpoints", 2)
    assert newest.read_bytes() == damaged

    resumed = cli("baseline", *small, "--num-epochs", "1", *dirs(tmp_path, "run"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping checkpoint {newest.name}" in resumed.stderr
    assert f"resumed from {previous}" in resumed.stderr

    for path in ckpt.list_checkpoints(folder):
        path.write_bytes(b"garbage")
    broken = cli("baseline", *small, *dirs(tmp_path, "run"), "--resume")
    one_line_error(broken, "no usable checkpoint", 1)
    assert all(p.read_bytes() == b"garbage" for p in ckpt.list_checkpoints(folder))


@pytest.mark.slow  # a training run of 3 epochs as a process (the module's)
@pytest.mark.timeout(240)  # the shared run too, for the first test that reads it
def test_summary_times_to_accuracy_and_tensorboard_hparams(whole_run):
    tmp_path, result = whole_run
    assert result.returncode == 0, result.stderr
    assert "Time to accuracy: 90% " in result.stdout
    logs = tmp_path / "run" / "logs"
    summary = json.loads((logs / "summary.json").read_text())
    evaluations = [(r["progress/train_time_s"], r["accuracy/test"])
                   for r in read_metrics(logs / "baseline" / "metrics.jsonl") if "accuracy/test" in r]
    assert len(evaluations) == 3 and evaluations[-1][1] == summary["final_accuracy"]
    assert [t for t, _ in evaluations] == sorted(t for t, _ in evaluations)
    assert 0 < evaluations[-1][0] <= summary["train_time_s"]
    # Each threshold's time is the clock of the first evaluation that reached it, else null.
    expected = {f"{t:.2f}": next((s for s, accuracy in evaluations if accuracy >= t), None)
                for t in (0.90, 0.95, 0.97, 0.98)}
    assert summary["time_to_accuracy_s"] == expected
    assert expected["0.90"] is not None  # digits passes 90% within 3 epochs; else nothing was tested

    values, metrics = read_hparams(logs / "hparams")
    assert {"strategy", "dataset", "model", "batch_size", "learning_rate", "optimizer", "world_size",
            "seed", "num_epochs"} <= set(values)
    assert (values["strategy"], values["batch_size"], values["optimizer"]) == ("baseline", 64, "sgd")
    assert metrics["hparam/final_accuracy"] == pytest.approx(summary["final_accuracy"])
    # Only the thresholds reached: TensorBoard takes no null.
    assert {k for k in metrics if k.startswith("hparam/time_to_accuracy_")} == {
        f"hparam/time_to_accuracy_{key}_s" for key, seconds in expected.items() if seconds is not None}
    assert metrics["hparam/time_to_accuracy_0.90_s"] == pytest.approx(expected["0.90"])
