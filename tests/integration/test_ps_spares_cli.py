"""Hot spares of the parameter server (`disttrain ps --spares K`), from the CLI: a worker
SIGKILLed mid-run is restarted on the spare that waited beside the run (its identity
handed over, no fresh process), every sample of every epoch is applied once, and the run
ends as the same run restarting the worker on a fresh process does. Also the refusal of
spares for an elastic run.

The run is the fault-tolerance tests' (digits, an MLP, 2 workers x 10 steps an epoch,
2 epochs, sync mode) with short heartbeats.
"""

import json

import pytest

from disttrain.coordinator.registry import read_status

TRAIN, TEST, BATCH, EPOCHS = 640, 200, 32, 2
ARGS = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--batch-size", str(BATCH),
        "--max-train-samples", str(TRAIN), "--max-test-samples", str(TEST), "--num-epochs", str(EPOCHS),
        "--checkpoint-interval", "5", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
        "--seed", "3", "--inject", "kill:worker=1:step=7"]


def run_ps(cli, folder, *extra):
    result = cli("ps", *ARGS, "--log-dir", folder / "logs", "--checkpoint-dir", folder / "ckpt", *extra,
                 timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "logs" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_killed_worker_is_restarted_on_the_hot_spare_and_every_sample_is_applied_once(tmp_path, cli):
    summary = run_ps(cli, tmp_path / "spare", "--spares", "1")
    # the servers' ledgers: no block missing, none applied twice
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN
    (failure,) = summary["failures"]
    assert failure["process"] == "worker1" and "SIGKILL" in failure["reason"]
    assert failure["spare"] == "spare0" and failure["first_step_s"] > 0
    (step_in,) = summary["spare_step_ins"]
    assert (step_in["slot"], step_in["spare"], step_in["attempt"]) == ("worker1", "spare0", 1)
    assert step_in["after_loss_s"] == failure["first_step_s"]
    # the spare, then the one started in its place after it stepped in
    assert (summary["num_spares"], summary["num_spares_started"]) == (1, 2)
    # worker1 ended in the spare's process, started before the kill: no fresh process for it
    nodes = {node["node_id"]: node for node in read_status(tmp_path / "spare" / "logs" / "cluster.db").nodes}
    assert nodes["worker1"]["pid"] == step_in["pid"] != nodes["worker0"]["pid"]
    assert nodes["worker1"]["restarts"] == 1 and nodes["worker1"]["state"] == "done"
    assert not list((tmp_path / "spare" / "logs").glob("*.handoff.json*"))  # read once, deleted

    # the same run restarting the worker on a fresh process ends as well as the spare's
    plain = run_ps(cli, tmp_path / "plain")
    assert plain["samples_lost"] == 0 and plain["samples_applied"] == EPOCHS * TRAIN
    assert "spare" not in plain["failures"][0] and "num_spares" not in plain
    assert summary["final_accuracy"] > 0.8
    assert summary["final_accuracy"] == pytest.approx(plain["final_accuracy"], abs=0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spares_for_an_elastic_run_are_refused_before_any_process_starts(tmp_path, cli):
    result = cli("ps", "--dataset", "digits", "--model", "mlp", "--workers", "2:3", "--spares", "1",
                 "--log-dir", tmp_path / "logs", "--checkpoint-dir", tmp_path / "ckpt", timeout=100)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "ps.spares" in line and "--workers MIN:MAX" in line
    assert not (tmp_path / "logs" / "worker0.log").exists()
