"""Sync parameter-server runs whose servers are restored from older checkpoints, again
and again, between worker kills: real processes (2 or 3 servers, 2 workers), faults
injected at exact points, and each test ends by checking state: the summary (from the
servers' ledgers: nothing lost, every sample of every epoch applied once) and the
failures the run recorded, which must be the injected ones alone. A worker that waited
for a step no shard would reach stopped with `StepsDisagree` after `--rpc-timeout`
seconds and was restarted: its exit is a failure nobody injected, and it spends the
run's restarts; a deadlock no deadline ends leaves the run unfinished.

The runs are small (digits, an MLP, 2 workers, batches of 16) with short heartbeats and
a short `--rpc-timeout`.
"""

import json

import pytest

TEST, BATCH = 100, 16
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", "2",
        "--batch-size", str(BATCH), "--max-test-samples", str(TEST), "--num-threads", "1",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5", "--seed", "3", "--rpc-timeout", "20",
        "--max-restarts", "8"]


def run_ps(cli, folder, faults, train, epochs, checkpoint_interval, servers=2):
    injected = [arg for fault in faults for arg in ("--inject", fault)]
    result = cli("ps", *ARGS, "--servers", servers, "--max-train-samples", train, "--num-epochs", epochs,
                 "--checkpoint-interval", checkpoint_interval, "--log-dir", folder / "logs",
                 "--checkpoint-dir", folder / "ckpt", *injected, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


def assert_only_the_injected_faults_and_nothing_lost(summary, faults, train, epochs):
    """From the servers' ledgers: no block missing on any shard, every sample of every
    epoch applied once; and no process failed but those the faults killed."""
    killed = sorted(fault.split(":")[1].replace("=", "") for fault in faults)
    assert sorted(f["process"] for f in summary["failures"]) == killed, summary["failures"]
    assert all("SIGKILL" in f["reason"] for f in summary["failures"]), summary["failures"]
    assert summary["samples_lost"] == 0
    assert summary["samples_applied"] == epochs * train


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.extended  # servers restored: the 3rd and 4th tests
def test_a_server_restored_mid_epoch_lets_the_next_epoch_start(tmp_path, cli):
    # Both workers redo the blocks shard 1 lost at the epoch's end, one after the other:
    # the first holds shard 1 at a version before the second's redos. Its first push of
    # the next epoch was dropped as late there, and it waited for shard 1 to apply a step
    # that waited for that very push.
    # (32 steps an epoch, checkpoints every 10: five blocks of each worker to redo)
    faults = ["kill:server=1:step=25"]
    summary = run_ps(cli, tmp_path, faults, train=1024, epochs=2, checkpoint_interval=10)
    assert_only_the_injected_faults_and_nothing_lost(summary, faults, train=1024, epochs=2)
    assert summary["samples_redone"] > 0


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.extended  # servers restored among worker restarts: the 3rd and 4th tests
def test_a_worker_restarted_after_a_server_restore_does_not_wait_for_the_steps_it_lost(tmp_path, cli):
    # Worker 1 dies, then server 1 (restored two steps back), then worker 0: a restarted
    # worker never saw the restore, and waited for shard 1 to reach the others' step by
    # itself (a stand-in moved it one step, then nothing did).
    # (16 steps an epoch, checkpoints every 5: shard 1 comes back at step 5)
    faults = ["kill:worker=1:step=8", "kill:server=1:step=9", "kill:worker=0:step=10"]
    summary = run_ps(cli, tmp_path, faults, train=512, epochs=1, checkpoint_interval=5)
    assert_only_the_injected_faults_and_nothing_lost(summary, faults, train=512, epochs=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_servers_killed_twice_before_their_checkpoints_among_worker_kills_lose_nothing(tmp_path, cli):
    # The kill-every-20-s run of a 2-epoch MNIST run (2 servers, 2 workers), at a smaller
    # size and at exact points (32 steps an epoch, checkpoints every 10 versions and at
    # the epochs' barriers): each server is killed, then killed again on its restart
    # before its next checkpoint (restored twice from the same one), and a worker is
    # killed after each.
    faults = ["kill:server=1:step=25", "kill:server=1:step=23:attempt=1", "kill:worker=0:step=40",
              "kill:server=0:step=47", "kill:server=0:step=48:attempt=1", "kill:worker=1:step=55"]
    summary = run_ps(cli, tmp_path, faults, train=1024, epochs=2, checkpoint_interval=10)
    assert_only_the_injected_faults_and_nothing_lost(summary, faults, train=1024, epochs=2)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_server_restored_twice_while_a_restarted_worker_replays_with_three_shards(tmp_path, cli):
    # Worker 0 restarts from the beginning while worker 1 trains on alone; shard 0 is then
    # restored twice from its step-5 checkpoint, the second time just after a step that
    # went on without worker 0 there: worker 1's push of that step waited there for worker
    # 0, blocked on the other shards' next step, which waited for worker 1 (a deadlock);
    # once that was mended, worker 0's push again to shard 0 waited for shard 0 to reach a
    # step that waited for that very push. Then servers 1 and 2 die, 2 twice.
    faults = ["kill:worker=0:step=4", "kill:server=0:step=7", "kill:server=0:step=6:attempt=1",
              "kill:server=1:step=20", "kill:server=2:step=19", "kill:server=2:step=16:attempt=1",
              "kill:worker=1:step=19"]
    summary = run_ps(cli, tmp_path, faults, train=512, epochs=2, checkpoint_interval=5, servers=3)
    assert_only_the_injected_faults_and_nothing_lost(summary, faults, train=512, epochs=2)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.extended  # servers restored among worker restarts: the 3rd and 4th tests
def test_servers_restored_while_a_worker_waits_at_the_epochs_end_for_a_restarted_one(tmp_path, cli):
    # Worker 0 dies and restarts from its step-10 checkpoint; worker 1 trains epoch 0 to its
    # end alone and waits at the epoch's barrier; server 1 is restored from its checkpoint
    # of before worker 1's last push of the epoch, and kept worker 0's steps of the epoch
    # waiting for worker 1 (a deadlock), until worker 1, watching the shards while it
    # waits, registered again and told it the epoch was done.
    faults = ["kill:worker=0:step=14", "kill:server=1:step=18", "kill:server=0:step=28"]
    summary = run_ps(cli, tmp_path, faults, train=512, epochs=2, checkpoint_interval=5)
    assert_only_the_injected_faults_and_nothing_lost(summary, faults, train=512, epochs=2)
