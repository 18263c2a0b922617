"""A parameter-server run's failures in its summary: each supervisor failure gets the
detection and recovery times of the coordinator's structured recovery record of that
process (matched in order, none where the process never came back), read from a real
registry file; a registry that cannot be read leaves the figures out."""

from __future__ import annotations

from disttrain.coordinator.membership import Membership
from disttrain.coordinator.registry import Registry
from disttrain.coordinator.reports import HeartbeatReport, NodeProcess
from disttrain.coordinator.supervisor import Failure
from disttrain.strategies.ps.run.recovery import recovery_summary

TIMEOUT_S = 2.0


def registry_of_a_run(path) -> None:
    """worker1 killed (exit reported) and back, then hung (missed heartbeats) and back;
    server0 killed and never back; worker0 a straggler."""
    membership = Membership(TIMEOUT_S, straggler_factor=2.0)
    pids = {"server0": 1, "worker0": 2, "worker1": 3, "worker2": 4}
    slow = {"worker0": 0.9}  # seconds a step; the others' 0.1

    def beat(now: float, *silent: str) -> None:
        for node_id, pid in pids.items():
            if node_id not in silent:
                assert membership.heartbeat(node_id, now=now, pid=pid,
                                            report=HeartbeatReport(step_time_s=slow.get(node_id, 0.1)))

    for node_id, pid in pids.items():
        membership.register(node_id, "server" if node_id.startswith("server") else "worker", now=0.0,
                            process=NodeProcess(pid))
    membership.exited("worker1", -9, "killed by SIGKILL", now=1.0)
    pids["worker1"] = 20
    membership.register("worker1", "worker", now=1.5, process=NodeProcess(20))
    beat(2.25)  # worker1 back 1.25 s after its exit
    beat(4.0, "worker1")  # worker1 hangs
    membership.check(now=4.75)  # declared 2.5 s after its last heartbeat
    pids["worker1"] = 21
    membership.register("worker1", "worker", now=6.0, process=NodeProcess(21))
    beat(7.0)  # back 2.25 s after that
    membership.exited("server0", -9, "killed by SIGKILL", now=7.5)
    del pids["server0"]
    for now in (8.0, 8.0 + TIMEOUT_S):  # worker0 slow for as long as the timeout: a straggler
        beat(now)
        membership.check(now)
    registry = Registry(path)
    registry.save(membership.to_rows(), [vars(e) for e in membership.take_events()], membership.generation,
                  membership.take_recoveries())
    registry.close()


def test_each_failure_gets_the_figures_of_its_process_recovery_record(tmp_path):
    path = tmp_path / "cluster.db"
    registry_of_a_run(path)
    failures = [Failure("worker1", "killed by SIGKILL", exited_at=100.0, restarted_at=100.5),
                Failure("worker1", "declared failed", exited_at=104.0, restarted_at=105.0),
                Failure("server0", "killed by SIGKILL", exited_at=106.0)]
    summary = recovery_summary(failures, path)
    assert summary == {"num_failures": 3, "stragglers": ["worker0"], "failures": [
        {"process": "worker1", "reason": "killed by SIGKILL", "restart_s": 0.5, "detect_s": 0.0,
         "recover_s": 1.25},
        {"process": "worker1", "reason": "declared failed", "restart_s": 1.0, "detect_s": 2.5,
         "recover_s": 2.25},
        {"process": "server0", "reason": "killed by SIGKILL"}]}


def test_without_a_readable_registry_the_figures_are_left_out(tmp_path):
    failures = [Failure("worker1", "killed by SIGKILL", exited_at=100.0, restarted_at=100.5)]
    expected = {"num_failures": 1, "stragglers": [], "failures": [
        {"process": "worker1", "reason": "killed by SIGKILL", "restart_s": 0.5}]}
    assert recovery_summary(failures, tmp_path / "missing.db") == expected
    (tmp_path / "corrupt.db").write_bytes(b"not a registry " * 100)
    assert recovery_summary(failures, tmp_path / "corrupt.db") == expected
