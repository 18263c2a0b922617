"""`disttrain ps --resume` where a worker's newest checkpoint is ahead of its shard's: the
store failed after worker 0 had saved step 10 (the end of epoch 0) but before the shard
and worker 1 had saved anything past step 5, so the shard comes back at step 5 without
worker 0's blocks of steps 6 to 10.

Going on from its step-10 checkpoint, worker 0 would start epoch 1 while worker 1 redoes
epoch 0: worker 1 waits at epoch 0's end for worker 0, and in sync mode worker 0's first
step of epoch 1 waits for worker 1 (the run hung). Worker 0 instead passes its step-10
checkpoint over (its last push is missing on the shard) for the newest one the shard
holds (in sync mode its step 5; in async mode, whose shard versions count pushes, an
older one or none), and the run finishes with every sample applied once. The state is
made by removing the newer checkpoints of a finished run, as a store that failed there
would have left them."""

import json

import pytest

TRAIN, EPOCHS = 640, 2  # 2 workers x 10 steps an epoch
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--batch-size", "32",
        "--max-train-samples", str(TRAIN), "--max-test-samples", "200", "--num-epochs", str(EPOCHS),
        "--checkpoint-interval", "5", "--seed", "3", "--set", "system.checkpoint_keep=10"]


def cut_after(folder, step):
    """Remove the checkpoints in `folder` past `step`, as if their saves had failed."""
    for path in folder.glob("checkpoint_step*.pt*"):
        if int(path.name.split(".")[0].removeprefix("checkpoint_step")) > step:
            path.unlink()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, shard_step", [("sync", 5),
                                              pytest.param("sync", 0, marks=pytest.mark.extended),
                                              pytest.param("async", 5, marks=pytest.mark.extended)],
                         ids=["sync", "sync-shard-at-start", "async"])
def test_a_worker_checkpoint_ahead_of_its_shard_resumes_from_one_the_shard_holds(tmp_path, cli, mode,
                                                                                  shard_step):
    """With the shard back at step 0 (its step-5 save was cut too), no worker checkpoint
    fits: both workers start from the beginning, and the run still applies each sample once."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    folders = ["--aggregation-mode", mode, "--checkpoint-dir", ckpt, "--log-dir", logs]
    first = cli("ps", *ARGS, *folders, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    cut_after(ckpt / "server0", shard_step)
    cut_after(ckpt / "worker1", 5)
    cut_after(ckpt / "worker0", 10)

    resumed = cli("ps", *ARGS, *folders, "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN
    worker0 = (logs / "worker0.log").read_text()
    assert "checkpoint_step00000010.pt does not fit the run: its last push" in worker0
    assert "checkpoint_step00000010.pt (epoch" not in worker0  # never resumed from there
    if mode == "sync" and shard_step == 5:  # each sync step is one version: the shard holds 5 steps of both
        assert "checkpoint_step00000005.pt (epoch 0, step 5)" in worker0 and summary["resumed_from_step"] == 5
    if shard_step == 0:
        assert "no checkpoint in" in worker0 and summary["resumed_from_step"] is None
