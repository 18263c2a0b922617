"""A parameter-server run across hosts: the coordinator and 2 shard servers on host a,
one worker on each of hosts b and c, every process started with the real commands and
reaching the others only by their 192.0.2.x addresses, with a token and mutual TLS.
Shared memory must not be used between hosts: they share this machine's /dev/shm, but
not a network namespace, so only the servers' rule (segments for a peer on their own
host) keeps the workers on gRPC."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hosts import host_tls, namespaces_reason, network, run_env  # noqa: F401  (fixtures)
from netns import Host, read_event

DISTTRAIN = [sys.executable, "-m", "disttrain"]
RUN_ARGS = ["--dataset", "digits", "--num-epochs", "1", "--max-train-samples", "256",
            "--max-test-samples", "100", "--batch-size", "32", "--num-threads", "1"]


def start_servers(a: Host, folder: Path, env: dict, tls: list[str]) -> tuple[str, list[str]]:
    """The coordinator and 2 shard servers on host a, each on a port it picked; their addresses."""
    logs, checkpoints = folder / "a" / "logs", folder / "a" / "ckpt"
    logs.mkdir(parents=True)
    log = folder / "coordinator.out"
    process = a.start([*DISTTRAIN, "coordinator", "--bind", f"{a.address}:0", "--registry",
                       str(logs / "cluster.db"), *tls], log, env)
    coordinator = read_event(log, "listening", process)["address"]
    servers = []
    for shard in range(2):
        log = folder / f"server{shard}.out"
        process = a.start([*DISTTRAIN, "ps-server", "--bind", f"{a.address}:0", "--shard", f"{shard}/2",
                           "--coordinator", coordinator, "--workers", "2", *RUN_ARGS, "--log-dir", str(logs),
                           "--checkpoint-dir", str(checkpoints), *tls], log, env)
        servers.append(read_event(log, "listening", process)["address"])
    return coordinator, servers


def start_worker(host: Host, rank: int, folder: Path, env: dict, tls: list[str], coordinator: str,
                 servers: list[str], extra: list[str] = ()):
    log = folder / f"worker{rank}.out"
    process = host.start([*DISTTRAIN, "ps-worker", "--servers", ",".join(servers), "--coordinator",
                          coordinator, "--rank", str(rank), "--worker-id", f"worker{rank}", *RUN_ARGS,
                          "--log-dir", str(folder / host.name / "logs"),
                          "--checkpoint-dir", str(folder / host.name / "ckpt"), *tls, *extra], log, env)
    return process, log


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_ps_run_across_three_hosts_with_token_and_mutual_tls_finishes_over_grpc(
        network, host_tls, run_env, tmp_path):
    net = network(["a", "b", "c"])
    a, b, c = net.hosts["a"], net.hosts["b"], net.hosts["c"]
    coordinator, servers = start_servers(a, tmp_path, run_env, host_tls(a))
    assert all(address.startswith("192.0.2.1:") for address in [coordinator, *servers])

    workers = [start_worker(host, rank, tmp_path, run_env, host_tls(host), coordinator, servers)
               for rank, host in enumerate([b, c])]
    for process, log in workers:
        process.wait(timeout=120)
        assert process.returncode == 0, log.read_text()[-3000:]

    summary = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ps-sync" and summary["samples_lost"] == 0
    assert summary["samples_applied"] == 256 and summary["steps"] > 0
    for shard in range(2):  # each server saw its workers come from the other hosts' addresses
        log = (tmp_path / f"server{shard}.out").read_text()
        assert "mutual: clients need a certificate" in log
        assert "from ipv4:192.0.2.2:" in log and "from ipv4:192.0.2.3:" in log, log[-3000:]
    for _, log in workers:
        assert "payloads go through shared memory" not in log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_on_another_host_is_offered_no_shared_memory(network, host_tls, run_env, tmp_path):
    net = network(["a", "b"])
    a, b = net.hosts["a"], net.hosts["b"]
    coordinator, servers = start_servers(a, tmp_path, run_env, host_tls(a))
    # Forcing shared memory makes the worker stop at registration when the server offers none.
    process, log = start_worker(b, 0, tmp_path, run_env, host_tls(b), coordinator, servers,
                                ["--set", "ps.payload_transport=shared_memory"])
    process.wait(timeout=90)
    assert process.returncode != 0
    assert "offered no shared memory" in log.read_text(), log.read_text()[-3000:]
