"""The SQLite registry on real files: round trip of nodes (metrics included), events and
recovery records, WAL, refusal of corrupt, foreign or older-schema files (left
untouched), locks, and the read-only status read."""

from __future__ import annotations

import sqlite3

import pytest

from disttrain.coordinator.membership import Membership
from disttrain.coordinator.nodes import Recovery
from disttrain.coordinator.registry import (
    REGISTRY_KIND,
    SCHEMA_VERSION,
    Registry,
    RegistryError,
    read_status,
)
from disttrain.coordinator.reports import HeartbeatReport, NodeProcess


def cluster() -> Membership:
    membership = Membership(heartbeat_timeout_s=5.0)
    membership.register("server-0", "server", now=0.0, rank=0, address="127.0.0.1:5000",
                        process=NodeProcess(10, hostname="node0",
                                            capabilities={"cpus": 8, "memory_bytes": 2**33, "gpu": ""}))
    membership.register("worker-0", "worker", now=0.0, rank=0, process=NodeProcess(11))
    membership.heartbeat("worker-0", now=1.0, pid=11,
                         report=HeartbeatReport(epoch=2, step=40, throughput=512.5, step_time_s=0.1))
    membership.report_metrics("worker-0", 40, {"loss/train": 0.31, "accuracy/test": 0.88})
    membership.exited("server-0", -9, "killed by SIGKILL", now=2.0)
    return membership


def recover(membership: Membership, node_id: str, now: float) -> None:
    """`node_id` (failed) registers again and heartbeats: one recovery."""
    node = membership.get(node_id)
    pid = node.pid + 100  # its restarted process
    membership.register(node_id, node.role, now=now, rank=node.rank, process=NodeProcess(pid))
    assert membership.heartbeat(node_id, now=now + 0.5, pid=pid)


def save(registry: Registry, membership: Membership, offset: float = 1000.0) -> None:
    events = [vars(e) for e in membership.take_events(offset)]
    registry.save(membership.to_rows(offset), events, membership.generation,
                  membership.take_recoveries(offset))


def test_nodes_events_and_generation_survive_a_reopen(tmp_path):
    path = tmp_path / "cluster" / "registry.db"
    membership = cluster()
    registry = Registry(path)
    save(registry, membership)
    registry.close()

    snapshot = Registry(path).load()
    assert snapshot.generation == membership.generation == 3
    assert snapshot.nodes == membership.to_rows(1000.0)
    assert [(e["node_id"], e["kind"]) for e in snapshot.events] == [
        ("server-0", "joined"), ("worker-0", "joined"), ("server-0", "failed")]
    assert snapshot.events[0]["time"] == 1000.0
    worker = next(n for n in snapshot.nodes if n["node_id"] == "worker-0")
    assert (worker["metrics"], worker["metrics_step"]) == ({"loss/train": 0.31, "accuracy/test": 0.88}, 40)


def test_recovery_records_are_kept_as_records_and_read_back_oldest_first(tmp_path):
    path = tmp_path / "r.db"
    membership = cluster()
    recover(membership, "server-0", now=3.0)
    registry = Registry(path)
    save(registry, membership)
    membership.exited("worker-0", 1, "exit code 1", now=5.0)
    recover(membership, "worker-0", now=6.0)
    save(registry, membership)
    expected = [Recovery("server-0", "killed by SIGKILL", 0.0, 1.5, 1003.5, 4),
                Recovery("worker-0", "exit code 1", 0.0, 1.5, 1006.5, 6)]
    assert registry.load().recoveries == expected
    registry.close()
    assert Registry(path).load().recoveries == expected  # across a reopen
    assert read_status(path).recoveries == expected
    assert read_status(path, max_recoveries=1).recoveries == expected[1:]  # the latest


def test_saving_again_updates_rows_in_place(tmp_path):
    registry = Registry(tmp_path / "r.db")
    membership = cluster()
    save(registry, membership)
    membership.heartbeat("worker-0", now=3.0, pid=11, report=HeartbeatReport(step=41))
    save(registry, membership)
    nodes = {n["node_id"]: n for n in registry.load().nodes}
    assert len(nodes) == 2 and nodes["worker-0"]["step"] == 41


def test_the_file_is_in_wal_mode(tmp_path):
    Registry(tmp_path / "r.db").close()
    with sqlite3.connect(tmp_path / "r.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("content", [b"this is not a database at all " * 100,
                                     b"SQLite format 3\x00" + b"\xff" * 2000])
def test_a_corrupt_file_is_refused_and_left_untouched(tmp_path, content):
    path = tmp_path / "r.db"
    path.write_bytes(content)
    with pytest.raises(RegistryError, match="not a disttrain cluster registry .*move it away"):
        Registry(path)
    with pytest.raises(RegistryError, match="not a disttrain cluster registry"):
        read_status(path)
    assert path.read_bytes() == content


def test_another_sqlite_database_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    before = path.read_bytes()
    with pytest.raises(RegistryError, match="not a disttrain cluster registry"):
        Registry(path)
    assert path.read_bytes() == before


def test_a_locked_file_says_who_may_hold_it(tmp_path):
    path = tmp_path / "r.db"
    Registry(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(RegistryError, match="locked by another process.*another coordinator"):
            Registry(path, busy_timeout_ms=50)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_status_reads_without_writing(tmp_path):
    path = tmp_path / "r.db"
    registry = Registry(path)
    membership = cluster()
    save(registry, membership)
    snapshot = read_status(path, max_events=2)
    assert snapshot.generation == 3 and len(snapshot.nodes) == 2
    assert [e["kind"] for e in snapshot.events] == ["joined", "failed"]  # the latest two
    registry.close()
    path.chmod(0o444)  # a read-only open must not need to write the database itself
    try:
        assert read_status(path).generation == 3
    finally:
        path.chmod(0o644)


def test_status_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(RegistryError, match=r"no cluster registry at .*missing\.db"):
        read_status(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()


def test_a_registry_of_another_schema_version_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # as the first schema wrote it: no recoveries table
        db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                         "CREATE TABLE nodes (node_id TEXT PRIMARY KEY, role TEXT NOT NULL);"
                         "CREATE TABLE events (id INTEGER PRIMARY KEY, detail TEXT);")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("kind", REGISTRY_KIND), ("schema_version", "1"),
                                                          ("generation", "1")])
    before = path.read_bytes()
    for open_it in (Registry, read_status):
        with pytest.raises(RegistryError, match=rf"schema version 1, this disttrain reads version "
                                                rf"{SCHEMA_VERSION}; use the disttrain that wrote it"):
            open_it(path)
    assert path.read_bytes() == before


def test_save_deletes_forgotten_nodes_and_keeps_the_latest_events_and_recoveries(tmp_path):
    registry = Registry(tmp_path / "registry.db")
    membership = cluster()
    registry.save(membership.to_rows(), [], membership.generation)
    events = [dict(time=float(i), node_id="worker-0", kind="joined", detail=str(i), generation=i)
              for i in range(30)]
    recoveries = [Recovery("worker-0", f"r{i}", 0.0, 1.0, float(i), i) for i in range(30)]
    for start in range(0, 30, 10):
        registry.save([], events[start:start + 10], membership.generation, recoveries[start:start + 10],
                      max_rows=12)
    registry.save([], [], membership.generation, forgotten=["server-0"])
    snapshot = registry.load(max_events=100)
    registry.close()
    assert [n["node_id"] for n in snapshot.nodes] == ["worker-0"]
    assert [e["detail"] for e in snapshot.events] == [str(i) for i in range(18, 30)]
    assert [r.reason for r in snapshot.recoveries] == [f"r{i}" for i in range(18, 30)]


def test_a_new_launch_starts_a_registry_of_its_own_whose_generations_go_on(tmp_path):
    """`run_registry`: the nodes and events of an earlier launch are gone (its processes
    ended with it), and its generation is where the new one starts: the shards'
    checkpoints hold the generations their workers registered in."""
    from disttrain.coordinator.launch import run_registry

    path = run_registry(tmp_path)
    membership = cluster()
    earlier = Registry(path)
    save(earlier, membership)
    earlier.close()
    assert read_status(path).events
    assert run_registry(tmp_path) == path
    snapshot = read_status(path)
    assert (snapshot.nodes, snapshot.events, snapshot.generation) == ([], [], membership.generation)
    assert membership.generation >= 2
    path.unlink()
    assert run_registry(tmp_path) == path and not path.exists()  # nothing before it: nothing made
