"""A DDP run across hosts: 2 nodes x 1 rank, each node running `disttrain ddp` with the
multi-node flags, meeting at torch's c10d rendezvous on the first node's 192.0.2.1
address, gloo all-reduce between the hosts, one coordinator watching both ranks."""

from __future__ import annotations

import json
import sys

import pytest
from hosts import namespaces_reason, network, run_env, start_coordinator  # noqa: F401  (fixtures)

from disttrain.coordinator.registry import read_status

DISTTRAIN = [sys.executable, "-m", "disttrain"]
RDZV_PORT = 29400  # in a fresh network namespace every port is free


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_ddp_run_on_two_hosts_under_c10d_rendezvous_finishes_on_both(network, run_env, tmp_path):
    net = network(["a", "b"])
    a, b = net.hosts["a"], net.hosts["b"]
    coordinator = start_coordinator(a, tmp_path, run_env)

    nodes = []
    for host in (a, b):
        folder = tmp_path / host.name
        log = tmp_path / f"node-{host.name}.out"
        # Both nodes share the checkpoint folder (as the README asks of several machines).
        process = host.start([*DISTTRAIN, "ddp", "--world-size", "2", "--nnodes", "2", "--rdzv-endpoint",
                              f"{a.address}:{RDZV_PORT}", "--rdzv-id", "multihost", "--backend", "gloo",
                              "--coordinator", coordinator, "--dataset", "digits", "--num-epochs", "1",
                              "--max-train-samples", "256", "--max-test-samples", "100", "--num-threads",
                              "1", "--timeout-s", "60", "--log-dir", str(folder / "logs"),
                              "--checkpoint-dir", str(tmp_path / "ckpt")], log, run_env)
        nodes.append((host, process, log))
    for host, process, log in nodes:
        process.wait(timeout=150)
        assert process.returncode == 0, f"node {host.name}:\n{log.read_text()[-3000:]}"

    summary = json.loads((tmp_path / "a" / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2, summary
    assert (tmp_path / "b" / "logs" / "rank1" / "metrics.jsonl").is_file()
    assert (tmp_path / "ckpt" / "ddp_final.pt").is_file()
    # each rank registered with the coordinator from its own host, and finished
    status = read_status(tmp_path / "cluster.db", max_events=100)
    assert {(n["node_id"], n["hostname"], n["state"]) for n in status.nodes} == {
        ("rank0", "host-a", "done"), ("rank1", "host-b", "done")}
