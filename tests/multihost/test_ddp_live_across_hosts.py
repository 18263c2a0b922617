"""Live DDP recovery across hosts: 2 nodes x 1 rank, each node running `disttrain ddp
--ddp-recovery live` with the multi-node flags; node a's launcher hosts the live store at
the rendezvous endpoint (its 192.0.2.1 address), node b's reaches it. Rank 1, on host b,
is SIGKILLed mid-epoch: rank 0 trains on alone in its own process, host b's launcher
starts rank 1 again, it rejoins over the network, and every global batch is applied
exactly once."""

from __future__ import annotations

import json
import sys

import pytest
from hosts import namespaces_reason, network, run_env, start_coordinator  # noqa: F401  (fixtures)

from disttrain.coordinator.registry import read_status

DISTTRAIN = [sys.executable, "-m", "disttrain"]
STORE_PORT = 29400  # in a fresh network namespace every port is free
EPOCHS, BATCH, TRAIN = 3, 16, 1024


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_on_one_host_rejoins_the_live_group_across_hosts(network, run_env, tmp_path):
    net = network(["a", "b"])
    a, b = net.hosts["a"], net.hosts["b"]
    coordinator = start_coordinator(a, tmp_path, run_env)

    nodes = []
    for host in (a, b):
        folder = tmp_path / host.name
        log = tmp_path / f"node-{host.name}.out"
        # rank 0, training alone after the kill, is stopped for 20 s (SIGSTOP, then SIGCONT):
        # rank 1's new process starts and asks to join meanwhile, however loaded the machine
        fault = "kill:rank=1:step=10" if host is b else "stop:rank=0:step=12:for=20s"
        # Both nodes share the checkpoint folder (as the README asks of several machines).
        process = host.start([*DISTTRAIN, "ddp", "--ddp-recovery", "live", "--world-size", "2",
                              "--nnodes", "2", "--rdzv-endpoint", f"{a.address}:{STORE_PORT}",
                              "--max-restarts", "1", "--coordinator", coordinator, "--dataset", "digits",
                              "--num-epochs", str(EPOCHS),
                              "--batch-size", str(BATCH), "--max-train-samples", str(TRAIN),
                              "--max-test-samples", "100", "--num-threads", "1", "--timeout-s", "60",
                              "--set", "training.model_architecture=mlp",
                              "--set", "coordinator.heartbeat_interval=0.2",
                              "--set", "coordinator.heartbeat_timeout=1",
                              "--log-dir", str(folder / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--inject", fault], log, run_env)
        nodes.append((host, process, log))
    for host, process, log in nodes:
        process.wait(timeout=200)
        assert process.returncode == 0, f"node {host.name}:\n{log.read_text()[-3000:]}"

    summary = json.loads((tmp_path / "a" / "logs" / "summary.json").read_text())
    assert summary["ddp_recovery"] == "live" and len(summary["rank_pids"]["0"]) == 1  # never restarted
    assert [r["kind"] for r in summary["live_recoveries"]] == ["shrink", "grow"]
    assert [r["members"] for r in summary["live_recoveries"]] == [[0], [0, 1]]
    assert summary["samples_applied"] == EPOCHS * (TRAIN // (2 * BATCH)) * 2 * BATCH
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert "injected fault: kill at step 10" in (tmp_path / "b" / "logs" / "rank1.log").read_text()
    assert (tmp_path / "ckpt" / "ddp_final.pt").is_file()
    status = read_status(tmp_path / "cluster.db", max_events=200)
    assert {(n["node_id"], n["hostname"]) for n in status.nodes} == {("rank0", "host-a"), ("rank1", "host-b")}
