"""SSP by steps, whole parameter-server runs from the CLI: a straggler holds the fast worker
within the bound, a killed worker is waited for and restarted, and the servers' ledgers
show every sample applied once, none refused as stale.

The bound is read from the workers' own metrics: a worker logs step s only after the
shard let it go on from step s, which needs every other worker's push of step s - tau,
which that worker sent after it logged step s - tau - 1. So, on the one clock of this
machine, worker 0's record of step s comes after worker 1's of step s - tau - 1.
"""

import json

import pytest

from disttrain.metrics.logger import read_metrics

TRAIN, BATCH, EPOCHS, TAU = 640, 32, 2, 1  # 10 steps a worker an epoch
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--batch-size", str(BATCH),
        "--max-train-samples", str(TRAIN), "--max-test-samples", "100", "--num-epochs", str(EPOCHS),
        "--aggregation-mode", "ssp", "--staleness", str(TAU), "--set", "training.log_interval=1",
        "--checkpoint-interval", "5", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
        "--seed", "3"]


def run_ps(cli, folder, *extra):
    result = cli("ps", *ARGS, "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt", *extra,
                 timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


def step_times(folder, worker: int) -> dict[int, float]:
    """When the worker logged each of its training steps (the last record of a step: a
    restarted worker logs again the steps it redoes)."""
    records = read_metrics(folder / "logs" / f"worker{worker}" / "metrics.jsonl")
    return {r["step"]: r["time"] for r in records if "loss/train" in r}


def assert_within_the_bound(folder, epoch_steps: int):
    """Within each epoch (a worker that ended its share holds nobody), no worker logged
    step s before the other logged step s - tau - 1."""
    times = [step_times(folder, 0), step_times(folder, 1)]
    for mine, other in (times, times[::-1]):
        for step, at in mine.items():
            behind = step - TAU - 1
            if behind >= 1 and (behind - 1) // epoch_steps == (step - 1) // epoch_steps:
                assert at > other[behind], (step, behind)


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_a_straggler_holds_the_fast_worker_within_the_bound_and_every_sample_is_applied_once(tmp_path, cli):
    summary = run_ps(cli, tmp_path, "--inject", "slow:worker=1:factor=20")
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN
    assert summary["num_rejected_stale"] == 0 and summary["num_duplicates"] == 0
    assert [w["samples"] for w in summary["workers"]] == [EPOCHS * TRAIN // 2] * 2
    assert_within_the_bound(tmp_path, TRAIN // 2 // BATCH)


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.extended  # a killed worker: test_ps_fault_tolerance
def test_a_killed_worker_is_waited_for_restarted_and_every_sample_is_applied_once(tmp_path, cli):
    summary = run_ps(cli, tmp_path, "--inject", "kill:worker=1:step=7")
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN
    assert summary["num_rejected_stale"] == 0
    (failure,) = summary["failures"]
    assert failure["process"] == "worker1" and "SIGKILL" in failure["reason"]
