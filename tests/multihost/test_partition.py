"""A network partition in a parameter-server run across hosts: worker 1's link is cut
mid-run and plugged back in; the run finishes and every sample is applied once.

Coordinator and 2 shard servers on host a, worker 0 on host b, worker 1 on host c (token
and mutual TLS, sync mode). No supervisor spans the namespaces, so the test plays its part
for the one process that needs it.

The cut lasts longer than the coordinator's heartbeat timeout, the harder of the two
cases: past it the worker is declared failed and fenced, and must rejoin. The link stays
down until the coordinator has declared worker 1 failed and worker 0 has gone on alone
(the servers stopped waiting for it), then comes back; worker 1 learns it was declared
failed and exits, as a process whose gradients must no longer be applied; the test
restarts it with `--resume` and the same id and rank, as a supervisor would. Its blocks
of the epoch are applied after it rejoins, what it computes again is turned away by the
servers' ledgers, and the summary's exactly-once figures come from those ledgers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hosts import host_tls, namespaces_reason, network, run_env  # noqa: F401  (fixtures)
from netns import Host, ip, read_event, wait_for

from disttrain.coordinator.registry import read_status
from disttrain.core.errors import DistributedError
from disttrain.core.processes import EVENT_PREFIX
from disttrain.strategies.ps.run.link import EXIT_DECLARED_FAILED

DISTTRAIN = [sys.executable, "-m", "disttrain"]
TRAIN, BATCH, EPOCHS, WORKERS = 1024, 8, 2, 2
STEPS_PER_EPOCH = TRAIN // WORKERS // BATCH
HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S = 0.5, 4.0
CUT_AT_STEP = 10
RUN_ARGS = ["--dataset", "digits", "--num-epochs", str(EPOCHS), "--max-train-samples", str(TRAIN),
            "--max-test-samples", "100", "--batch-size", str(BATCH), "--num-threads", "1",
            "--checkpoint-interval", "4", "--seed", "5", "--rpc-timeout", "20",
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]


class Run:
    """The processes of one run across hosts a, b, c, and where each one writes."""

    def __init__(self, net, folder: Path, env: dict, tls):
        self.hosts = net.hosts
        self.folder, self.env, self.tls = folder, env, tls
        self.registry = folder / "a" / "logs" / "cluster.db"

    def start_cluster(self) -> None:
        a = self.hosts["a"]
        logs = self.folder / "a" / "logs"
        logs.mkdir(parents=True)
        log = self.folder / "coordinator.out"
        self.coordinator_process = a.start(
            [*DISTTRAIN, "coordinator", "--bind", f"{a.address}:0", "--registry", str(self.registry),
             "--set", f"coordinator.heartbeat_interval={HEARTBEAT_INTERVAL_S}",
             "--set", f"coordinator.heartbeat_timeout={HEARTBEAT_TIMEOUT_S}", *self.tls(a)], log, self.env)
        self.coordinator = read_event(log, "listening", self.coordinator_process)["address"]
        self.servers, self.server_processes = [], []
        for shard in range(2):
            log = self.folder / f"server{shard}.out"
            process = a.start([*DISTTRAIN, "ps-server", "--bind", f"{a.address}:0", "--shard", f"{shard}/2",
                               "--coordinator", self.coordinator, "--workers", str(WORKERS), *RUN_ARGS,
                               "--log-dir", str(logs), "--checkpoint-dir", str(self.folder / "a" / "ckpt"),
                               *self.tls(a)], log, self.env)
            self.servers.append(read_event(log, "listening", process)["address"])
            self.server_processes.append(process)

    def start_worker(self, rank: int, host: Host, name: str, extra: tuple[str, ...] = ()):
        log = self.folder / f"{name}.out"
        process = host.start([*DISTTRAIN, "ps-worker", "--servers", ",".join(self.servers),
                              "--coordinator", self.coordinator, "--rank", str(rank),
                              "--worker-id", f"worker{rank}", *RUN_ARGS,
                              "--log-dir", str(self.folder / host.name / "logs"),
                              "--checkpoint-dir", str(self.folder / host.name / "ckpt"), *self.tls(host),
                              *extra], log, self.env)
        return process, log

    def nodes(self) -> dict[str, dict]:
        """The coordinator's registry, node by node (empty until it has written one)."""
        if not self.registry.exists():
            return {}
        return {node["node_id"]: node for node in read_status(self.registry).nodes}

    def events(self) -> list[dict]:
        return read_status(self.registry, max_events=200).events


def steps_in(log: Path) -> int:
    """The steps a worker has reported so far, from the progress events it prints as it ends
    each step (unbuffered: they show at once, unlike its metrics file)."""
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in log.read_text().splitlines()
              if line.startswith(EVENT_PREFIX)]
    return sum(event["steps"] for event in events if event["event"] == "progress")


def finished(process, log: Path, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{log.name} still running after {timeout_s:g}s:\n"
                             f"{log.read_text()[-3000:]}") from e


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_cut_off_past_the_heartbeat_timeout_rejoins_and_nothing_is_lost(
        network, host_tls, run_env, tmp_path):
    net = network(["a", "b", "c"])
    b, c = net.hosts["b"], net.hosts["c"]
    run = Run(net, tmp_path, run_env, host_tls)
    run.start_cluster()
    worker0, log0 = run.start_worker(0, b, "worker0")
    worker1, log1 = run.start_worker(1, c, "worker1")

    wait_for(lambda: steps_in(log1) >= CUT_AT_STEP, 120, f"worker 1 at step {CUT_AT_STEP}", poll_s=0.01)
    c.set_link(False)
    assert worker1.poll() is None and steps_in(log1) < EPOCHS * STEPS_PER_EPOCH, "cut too late"

    # Held down until the coordinator declared worker 1 failed, and worker 0 went on without it.
    wait_for(lambda: run.nodes()["worker1"]["state"] == "failed", HEARTBEAT_TIMEOUT_S + 30,
             "the coordinator to declare worker 1 failed")
    alone_from = steps_in(log0)
    wait_for(lambda: steps_in(log0) >= alone_from + 3, 60, "worker 0 to step on without worker 1")
    assert worker1.poll() is None  # cut off, it had no way to learn it was declared failed
    c.set_link(True)

    # Back on the network, it learns it was declared failed from whichever answers first: the
    # coordinator (its heartbeat: exit 75) or a shard refusing its push of the old generation.
    exit_code, cut_log = finished(worker1, log1, 60), log1.read_text()
    verdicts = {EXIT_DECLARED_FAILED: "the coordinator declared worker1 failed",
                DistributedError.exit_code: "worker rank 1 was declared failed"}
    assert exit_code in verdicts and verdicts[exit_code] in cut_log, cut_log[-3000:]
    worker1, log1 = run.start_worker(1, c, "worker1-resumed", ("--resume",))

    for process, log in ((worker0, log0), (worker1, log1)):
        assert finished(process, log, 180) == 0, log.read_text()[-3000:]
    assert "resumed from" in log1.read_text()  # from its own checkpoint, not from scratch
    for shard, process in enumerate(run.server_processes):  # servers stop once every worker is done
        assert finished(process, tmp_path / f"server{shard}.out", 60) == 0

    summary = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())
    assert summary["strategy"] == "ps-sync"
    assert summary["samples_lost"] == 0 and summary["samples_applied"] == EPOCHS * TRAIN
    nodes = run.nodes()
    assert nodes["worker1"]["state"] == "done" and nodes["worker0"]["state"] == "done"
    assert any(e["kind"] == "failed" and e["node_id"] == "worker1" for e in run.events())
    # The servers stopped waiting for it within about a heartbeat timeout of the cut.
    assert summary["max_round_wait_s"] <= HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S + 2.0
    if exit_code == DistributedError.exit_code:
        assert summary["num_fenced"] >= 1
    print(f"partition figures: samples_applied {summary['samples_applied']} of {EPOCHS * TRAIN}, "
          f"samples_lost {summary['samples_lost']}, samples_redone {summary.get('samples_redone')}, "
          f"max_round_wait_s {summary['max_round_wait_s']:.2f}, worker 1 exit {exit_code}")

    # Nothing is left running: the coordinator stops on SIGTERM, and no host holds a process.
    run.coordinator_process.terminate()
    assert finished(run.coordinator_process, tmp_path / "coordinator.out", 30) == 0
    for namespace in net.namespaces():
        assert ip("netns", "pids", namespace).stdout.strip() == "", namespace
