"""The restart budget of a whole parameter-server run (`coordinator.budget`): real
processes, faults injected at exact points. A process killed after making progress is
restarted however often it dies; one that dies again without progress spends the budget
and stops the run with one line; a user's error stops the run at once. Each test ends by
checking state (the servers' ledgers through the summary, the coordinator's registry,
the checkpoints), and the one line a user reads.

The run is small (digits, an MLP, 2 workers x 10 steps per epoch) with short heartbeats.
"""

import json
import re

import pytest

from disttrain.coordinator.registry import read_status
from disttrain.core.checkpoint import checkpoint_step, latest_checkpoint

TRAIN, BATCH, WORKERS = 640, 32, 2
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", str(WORKERS), "--max-train-samples", str(TRAIN),
        "--max-test-samples", "200", "--batch-size", str(BATCH), "--num-threads", "1",
        "--checkpoint-interval", "5", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
        "--seed", "3", "--max-restarts", "1",
        # a worker past its budget stops the run (it is not left out for the others to cover)
        "--set", "coordinator.reassign_after=null"]


def run_ps(cli, folder, *extra):
    return cli("ps", *ARGS, "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt", *extra,
               timeout=200)


def restarts(folder):
    return {n["node_id"]: n["restarts"] for n in read_status(folder / "logs" / "cluster.db").nodes}


def last_line(result):
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.timeout(300)
@pytest.mark.slow  # a run restarted several times: make test runs it, make test-fast does not
def test_processes_killed_after_progress_more_often_than_max_restarts_are_restarted_and_the_run_finishes(
        tmp_path, cli):
    # worker 1 killed 4 times and the server twice, each start a little further than the one
    # before (a step past the furthest any earlier start reached), under a budget of 1
    kills = [f"kill:worker=1:step={step}:attempt={attempt}" for attempt, step in enumerate((5, 9, 13, 17))]
    kills += ["kill:server=0:step=8", "kill:server=0:step=14:attempt=1"]
    result = run_ps(cli, tmp_path, "--num-epochs", "2", *[a for kill in kills for a in ("--inject", kill)])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == 2 * TRAIN
    failed = [(f["process"], f["reason"]) for f in summary["failures"]]
    assert sorted(failed) == [("server0", "killed by SIGKILL")] * 2 + [("worker1", "killed by SIGKILL")] * 4
    assert all(f["restart_s"] >= 0 for f in summary["failures"])  # every one of them was started again
    counts = restarts(tmp_path)
    assert counts["worker1"] == 4 and counts["worker0"] == 0  # worker 1 registered again after each kill


@pytest.mark.timeout(300)
@pytest.mark.slow  # a run restarted several times: make test runs it, make test-fast does not
def test_a_process_that_dies_again_without_progress_stops_the_run_after_max_restarts_in_a_row(tmp_path, cli):
    # killed at step 7 (its step-5 checkpoint written), then on each start at step 6, before
    # it ever gets past step 7 again: the first restart is free, the next two are a crash loop
    kills = ["kill:worker=1:step=7", "kill:worker=1:step=6:attempt=1", "kill:worker=1:step=6:attempt=2"]
    result = run_ps(cli, tmp_path, "--num-epochs", "1", *[a for kill in kills for a in ("--inject", kill)])
    assert result.returncode == 1
    line = last_line(result)
    assert line.startswith("error: worker1 killed by SIGKILL without progress (never past step 7, its "
                           "furthest), 2 time(s) in a row (coordinator.max_restarts=1): a crash loop; the "
                           "cluster was stopped"), line
    assert "--resume" in line and "worker1.log" in line
    assert restarts(tmp_path)["worker1"] == 2  # started three times in all, never a fourth
    # no start of it checkpointed past step 5: each resumed from there
    assert checkpoint_step(latest_checkpoint(tmp_path / "ckpt" / "worker1")) == 5
    assert not (tmp_path / "logs" / "summary.json").exists()


@pytest.mark.timeout(300)
@pytest.mark.slow  # a parameter-server run: make test runs it, make test-fast does not
def test_a_users_error_stops_the_run_at_once_with_it_in_the_last_line_and_nothing_is_restarted(tmp_path, cli):
    result = run_ps(cli, tmp_path, "--num-epochs", "1", "--optimizer", "sgd", "--learning-rate", "1e30")
    assert result.returncode == 1
    assert re.fullmatch(r"error: worker[01]: the gradient of step \d+ holds NaN or infinity, .*training "
                        r"diverged; lower the learning rate or check the data \(not restarted: a restart "
                        r"would fail the same way\); fix it, then run the same command with --resume",
                        last_line(result))
    assert "Traceback" not in result.stderr
    assert set(restarts(tmp_path).values()) == {0}  # no process was started a second time


USER_MODEL = '''
import math
from torch import nn


class FailsAtItsFourthBatch(nn.Module):
    """A user's model with a bug that shows at its fourth training batch, every time."""

    def __init__(self, features, classes):
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.batches = 0

    def forward(self, x):
        if self.training:
            self.batches += 1
            if self.batches == 4:
                raise ValueError("batch 4 does not fit this model")
        return self.linear(x.flatten(1))


def model(description):
    return FailsAtItsFourthBatch(math.prod(description.input_shape), description.num_classes)
'''


@pytest.mark.slow  # the budget's rule is stepped in unit tests, the error event by the user's error above
@pytest.mark.timeout(300)
@pytest.mark.extended  # see the comment on the line above
def test_the_same_unexpected_error_at_the_same_step_on_a_fresh_start_stops_the_run(tmp_path, cli):
    plugin = tmp_path / "user_model.py"
    plugin.write_text(USER_MODEL)
    result = run_ps(cli, tmp_path, "--num-epochs", "1", "--model", f"{plugin}:model", "--max-restarts", "3")
    assert result.returncode == 1
    # each worker: the error after step 3 may be a fault once (restarted, from scratch: no
    # checkpoint yet); the same error after step 3 again is a bug, whatever budget is left
    assert re.fullmatch(r"error: worker[01] failed with the same error after step 3 on a fresh start, so "
                        r"it is a bug, not a fault \(not restarted again\): ValueError: batch 4 does not fit "
                        r"this model; fix it, then run the same command with --resume; its log: "
                        r".*worker[01]\.log",
                        last_line(result))
    assert max(restarts(tmp_path).values()) == 1


# -- DDP, restart mode: torch's elastic agent restarts the whole group as the budget grants --------

DDP_ARGS = ["--world-size", "2", "--dataset", "digits", "--model", "mlp", "--max-train-samples", str(TRAIN),
            "--max-test-samples", "200", "--batch-size", str(BATCH), "--num-threads", "1",
            "--checkpoint-interval", "5", "--seed", "3", "--max-restarts", "1"]


def run_ddp(cli, folder, *extra):
    return cli("ddp", *DDP_ARGS, "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt", *extra,
               timeout=250)


@pytest.mark.timeout(300)
@pytest.mark.slow  # a run restarted several times: make test runs it, make test-fast does not
def test_a_rank_group_killed_after_each_new_checkpoint_more_often_than_max_restarts_finishes(tmp_path, cli):
    # rank 1 killed on each start two steps past a checkpoint (5, 10, 15): every restart resumes
    # from a checkpoint newer than the one before, so none spends the budget of 1
    kills = [f"kill:rank=1:step={step}:attempt={attempt}" for attempt, step in enumerate((7, 12, 17))]
    result = run_ddp(cli, tmp_path, "--num-epochs", "2", *[a for kill in kills for a in ("--inject", kill)])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["restarts"] == 3 and summary["resumed_from_step"] == 15  # the group's last start
    assert summary["steps"] == 2 * TRAIN // (2 * BATCH) and summary["samples_processed"] == 2 * TRAIN
    assert checkpoint_step(latest_checkpoint(tmp_path / "ckpt")) == 20


@pytest.mark.slow  # the budget's stop is run end to end by the parameter server's crash loop above
@pytest.mark.timeout(300)
@pytest.mark.extended  # the budget's stop: the crash loop above
def test_a_rank_group_that_dies_again_before_its_next_checkpoint_stops_after_max_restarts_in_a_row(
        tmp_path, cli):
    result = run_ddp(cli, tmp_path, "--num-epochs", "1", "--inject", "kill:rank=1:step=7",
                     "--inject", "kill:rank=1:step=6:attempt=1", "--inject", "kill:rank=1:step=6:attempt=2")
    assert result.returncode == 1
    line = last_line(result)
    assert line.startswith("error: the rank group failed (rank 1 killed by SIGKILL) without progress "
                           "(never past checkpoint step 5, its furthest), 2 time(s) in a row "
                           "(ddp.max_restarts=1): a crash loop"), line
    assert checkpoint_step(latest_checkpoint(tmp_path / "ckpt")) == 5


# -- DDP, live mode: the launcher restarts a rank, which rejoins the running group -----------------

@pytest.mark.slow  # a live rank's rejoin is run end to end in test_ddp_live_cli; this adds the budget
@pytest.mark.timeout(500)
@pytest.mark.extended  # the budget: the tests above
def test_a_live_rank_killed_after_progress_more_often_than_max_restarts_rejoins_each_time(tmp_path, cli):
    # Rank 1 is killed at step 10, and its next process at its first step in the group (the
    # group's step by then, past 10): both after progress, under a budget of 1. Rank 0
    # straggles so the run outlasts two restarts. A straggler's step is slowed with its waits
    # for peers, and every member waits for all the others at each step boundary (the join
    # and leave check), so its first step beside a rank that joins and dies can take seconds:
    # the survivors' window to re-form (twice the heartbeat timeout) must outlast it, or the
    # straggler is left out and the fast rank alone ends the run before anyone rejoins.
    result = cli("ddp", "--world-size", 3, "--ddp-recovery", "live", "--dataset", "digits", "--model", "mlp",
                 "--num-epochs", 8, "--batch-size", 16, "--seed", 1, "--timeout-s", 60, "--max-restarts", 1,
                 "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=4",
                 "--inject", "kill:rank=1:step=10", "--inject", "kill:rank=1:step=10:attempt=1",
                 "--inject", "slow:rank=0:factor=10", "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=450)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    pids = summary["rank_pids"]
    assert len(pids["1"]) == 3 and summary["final_pids"]["1"] == pids["1"][2]  # two restarts, in at the end
    assert len(pids["0"]) == len(pids["2"]) == 1  # the survivors kept their processes
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
