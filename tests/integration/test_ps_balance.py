"""Parameter-server workers of unequal speed (`--balance`), whole runs from the CLI.

Under a plan the global batches are fixed and only split differently, so a synchronous
run still equals one process stepping on the global batches, whatever the plans were; a
straggler that appears mid-run is re-planned around, and the servers' ledgers show every
sample applied once.
"""

import json

import pytest
from ps_reference import assert_matches_one_process

from disttrain.coordinator.registry import read_status
from disttrain.core.checkpoint import load_checkpoint
from disttrain.data import PlannedSampler

ARGS = ["--dataset", "digits", "--model", "mlp", "--optimizer", "sgd", "--set", "training.momentum=0",
        "--learning-rate", "0.1", "--batch-size", "16", "--max-test-samples", "60"]


def run(cli, tmp_path, *extra):
    result = cli("ps", "--workers", "2", *ARGS, "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", *extra, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "logs" / "summary.json").read_text())


def assert_matches_the_global_batches(tmp_path, global_batch: int):
    """The final model equals one process's stepping with plain SGD on each global batch."""

    def global_batches(config, train_set):
        whole = PlannedSampler(len(train_set), world_size=1, rank=0, seed=config.training.seed,
                               shares=(global_batch,))
        for epoch in range(config.training.num_epochs):
            whole.set_epoch(epoch)
            yield from whole.batches()

    assert_matches_one_process(tmp_path, global_batches)


# Speeds measured in the run decide what it does: no other test may share the cores (make test
# runs the `serial` tests after the others, one at a time).
pytestmark = pytest.mark.serial


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_sync_workers_of_24_and_8_match_one_process_on_the_global_batches_of_32(tmp_path, cli):
    summary = run(cli, tmp_path, "--max-train-samples", "96", "--num-epochs", "1", "--balance",
                     "proportional", "--set", "system.balance_batches=24,8")
    assert summary["steps"] == 3 and summary["samples_processed"] == 96 and summary["samples_lost"] == 0
    assert summary["balance_plans"] == [[0, 0, [24, 8]]]
    assert [w["samples"] for w in summary["workers"]] == [72, 24]
    assert_matches_the_global_batches(tmp_path, 32)


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_a_straggler_appearing_mid_run_is_re_planned_around_with_every_sample_applied_once(tmp_path, cli):
    summary = run(cli, tmp_path, "--max-train-samples", "640", "--num-epochs", "2",
                     "--balance", "auto", "--balance-interval", "4", "--set", "system.balance_batches=16,16",
                     "--heartbeat-interval", "0.2", "--inject", "slow:worker=1:factor=20:step=10")
    plans = summary["balance_plans"]
    assert plans[0] == [0, 0, [16, 16]] and summary["balance_replans"] >= 1, plans
    first_after = next(p for p in plans if (p[0], p[1]) > (0, 8))
    assert (first_after[0], first_after[1]) <= (0, 16), plans  # within two checks of the slowdown
    assert first_after[2][1] < first_after[2][0] and plans[-1][2][1] < plans[-1][2][0], plans
    assert "re-planned after step" in (tmp_path / "logs" / "worker0.log").read_text()
    events = read_status(tmp_path / "logs" / "cluster.db", max_events=200).events
    assert any(e["kind"] == "rebalanced" and e["node_id"] == "worker1" for e in events), events
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 2 * 20 * 32
    assert summary["samples_processed"] == 2 * 20 * 32
    assert_matches_the_global_batches(tmp_path, 32)


@pytest.mark.slow
@pytest.mark.timeout(160)
# SSP balances as async does, within a bound: make test-extended runs it
@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.extended)])
def test_asynchronous_workers_take_their_shares_of_every_epoch_once(tmp_path, cli, mode):
    summary = run(cli, tmp_path, "--max-train-samples", "320", "--num-epochs", "2",
                     "--aggregation-mode", mode, "--staleness", "2", "--balance", "proportional",
                     "--set", "system.balance_batches=24,8", "--balance-interval", "0")  # this plan only
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 2 * 10 * 32
    assert [w["samples"] for w in summary["workers"]] == [2 * 10 * 24, 2 * 10 * 8]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_worker_killed_after_a_re_plan_resumes_into_the_same_plans_and_nothing_is_lost(tmp_path, cli):
    summary = run(cli, tmp_path, "--max-train-samples", "640", "--num-epochs", "2",
                  "--balance", "auto", "--balance-interval", "4", "--set", "system.balance_batches=16,16",
                  "--checkpoint-interval", "5", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
                  "--inject", "slow:worker=1:factor=20:step=4", "--inject", "kill:worker=1:step=14")
    assert summary["balance_replans"] >= 1 and summary["failures"][0]["process"] == "worker1"
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 2 * 20 * 32
    # the restarted worker took the plans its barriers' kept answers gave: the same as worker 0's
    assert "resumed from" in (tmp_path / "logs" / "worker1.log").read_text()
    newest = max((tmp_path / "ckpt" / "worker1").glob("checkpoint_step*.pt"))
    assert load_checkpoint(newest)["sampler"]["plans"] == summary["balance_plans"]
