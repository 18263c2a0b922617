"""The cluster registry: the coordinator's nodes, events and recoveries in one SQLite
file, so a restarted coordinator (or `disttrain status --registry`, or a run's summary)
sees the cluster as it was.

Only the coordinator writes it. The file is opened in WAL mode (a reader never blocks
the writer) with a busy timeout; times in it are wall-clock seconds since the epoch.
A file that is not a registry, or a registry of another schema version, is never written
to: the user decides what to do with it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote

from disttrain.coordinator.nodes import Recovery
from disttrain.core.errors import DisttrainError

SCHEMA_VERSION = 2
REGISTRY_KIND = "disttrain-cluster-registry"
BUSY_TIMEOUT_MS = 5000
MAX_ROWS = 10_000  # events and recoveries kept; older ones are pruned as new ones come

# column -> SQL type; one row per node, the same keys as the coordinator's node records.
NODE_COLUMNS = {
    "node_id": "TEXT PRIMARY KEY", "role": "TEXT NOT NULL", "rank": "INTEGER", "address": "TEXT",
    "hostname": "TEXT", "pid": "INTEGER", "capabilities": "TEXT", "state": "TEXT NOT NULL",
    "joined_generation": "INTEGER", "restarts": "INTEGER", "last_heartbeat": "REAL",
    "last_seen": "REAL", "epoch": "INTEGER", "step": "INTEGER", "throughput": "REAL",
    "step_time_s": "REAL", "straggler": "INTEGER", "failed_at": "REAL", "last_heard": "REAL",
    "failure_reason": "TEXT", "recovering": "INTEGER", "batch_size": "INTEGER", "warmup_speed": "REAL",
    "plans": "INTEGER", "metrics": "TEXT", "metrics_step": "INTEGER",
}
EVENT_COLUMNS = ("time", "node_id", "kind", "detail", "generation")
RECOVERY_COLUMNS = tuple(f.name for f in fields(Recovery))
_BOOL_COLUMNS = ("straggler", "recovering")
_JSON_COLUMNS = ("capabilities", "metrics")

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes ({", ".join(f"{k} {t}" for k, t in NODE_COLUMNS.items())});
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL,
    node_id TEXT NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL, generation INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS recoveries (id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL,
    reason TEXT NOT NULL, detect_s REAL NOT NULL, recover_s REAL NOT NULL, time REAL NOT NULL,
    generation INTEGER NOT NULL);
"""
TABLES = {"meta", "nodes", "events", "recoveries"}


class RegistryError(DisttrainError):
    """The registry file cannot be used: missing, not a registry, corrupt or locked. Not
    recoverable automatically: the message says what to do with the file."""


@dataclass
class Snapshot:
    """Everything a registry holds: the generation, every node, the latest events and
    recoveries (oldest first)."""

    generation: int = 0
    nodes: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)


class Registry:
    """The registry at `path`, created when absent. Safe to call from several threads.

    Raises:
        RegistryError: the file is not a registry (or is corrupt), is locked by another
            process, or cannot be created.
    """

    def __init__(self, path: str | Path, busy_timeout_ms: int = BUSY_TIMEOUT_MS):
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryError(f"cannot create the folder of registry {self.path}: {e}") from e
        try:
            # Private to its owner from its first byte (sqlite gives its -wal and -shm files
            # the same mode): it names every node of the run, their hosts and pids.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as e:
            raise RegistryError(f"cannot create registry {self.path}: {e.strerror or e}") from e
        with _translated(self.path):
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_ms / 1000,
                                       check_same_thread=False, isolation_level=None)
            try:
                self._open(busy_timeout_ms)
            except BaseException:
                self._db.close()
                raise

    def _open(self, busy_timeout_ms: int) -> None:
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        _check_kind(self._db, self.path, allow_empty=True)  # before any write
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")  # durable across process crashes
        with _transaction(self._db):
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            for key, value in (("kind", REGISTRY_KIND), ("schema_version", SCHEMA_VERSION)):
                self._db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, str(value)))
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('generation', '0')")

    def save(self, nodes: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]],
             generation: int, recoveries: Iterable[Recovery] = (), forgotten: Iterable[str] = (),
             max_rows: int = MAX_ROWS) -> None:
        """Upsert `nodes`, delete the nodes `forgotten`, append `events` and `recoveries`
        (keeping the latest `max_rows` of each) and store `generation`, in one transaction.

        Raises:
            RegistryError: the file is locked past the busy timeout, or the disk failed.
        """
        node_rows = [_node_values(node) for node in nodes]
        event_rows = [tuple(event[c] for c in EVENT_COLUMNS) for event in events]
        recovery_rows = [astuple(recovery) for recovery in recoveries]
        with self._lock, _translated(self.path), _transaction(self._db):
            self._db.executemany(_insert("INSERT OR REPLACE", "nodes", NODE_COLUMNS), node_rows)
            self._db.executemany(_insert("INSERT", "events", EVENT_COLUMNS), event_rows)
            self._db.executemany(_insert("INSERT", "recoveries", RECOVERY_COLUMNS), recovery_rows)
            self._db.executemany("DELETE FROM nodes WHERE node_id = ?", [(n,) for n in forgotten])
            for table, added in (("events", event_rows), ("recoveries", recovery_rows)):
                if added:  # ids only grow: the oldest rows are those below the newest - max_rows
                    self._db.execute(f"DELETE FROM {table} WHERE id <= (SELECT MAX(id) FROM {table}) - ?",
                                     (max_rows,))
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'generation'", (str(generation),))

    def load(self, max_events: int = 100, max_recoveries: int | None = None) -> Snapshot:
        """The generation, every node, the latest `max_events` events and the latest
        `max_recoveries` recoveries (None: all), oldest first."""
        with self._lock, _translated(self.path):
            return _snapshot(self._db, max_events, max_recoveries)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_status(path: str | Path, max_events: int = 20, max_recoveries: int | None = None) -> Snapshot:
    """Read a registry without writing to it (the file is opened read-only): as `load`.

    Raises:
        RegistryError: no file at `path`, not a registry, corrupt, or locked.
    """
    path = Path(path)
    if not path.is_file():
        raise RegistryError(f"no cluster registry at {path}; pass the --registry of a coordinator "
                            "(`disttrain coordinator --registry PATH`)")
    with _translated(path):
        db = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True,
                             timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            _check_kind(db, path, allow_empty=False)
            return _snapshot(db, max_events, max_recoveries)
        finally:
            db.close()


def _check_kind(db: sqlite3.Connection, path: Path, allow_empty: bool) -> None:
    """Raise RegistryError unless `db` is a registry (or, with `allow_empty`, has no tables)."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables and allow_empty:
        return
    kind = version = None
    if "meta" in tables:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        kind, version = meta.get("kind"), meta.get("schema_version")
    if kind != REGISTRY_KIND:
        raise RegistryError(_not_a_registry(path))
    if version != str(SCHEMA_VERSION):
        raise RegistryError(f"{path} is a cluster registry of schema version {version}, this disttrain "
                            f"reads version {SCHEMA_VERSION}; use the disttrain that wrote it, or "
                            "pass another --registry")
    if not TABLES <= tables:
        raise RegistryError(_not_a_registry(path))


def _not_a_registry(path: Path) -> str:
    return (f"{path} is not a disttrain cluster registry (or is corrupt); move it away or "
            "pass another --registry")


def _insert(verb: str, table: str, columns: tuple[str, ...] | dict[str, str]) -> str:
    return f"{verb} INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _snapshot(db: sqlite3.Connection, max_events: int, max_recoveries: int | None) -> Snapshot:
    generation = db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
    nodes = [_node_dict(dict(zip(NODE_COLUMNS, row, strict=True))) for row in
             db.execute(f"SELECT {', '.join(NODE_COLUMNS)} FROM nodes ORDER BY role, rank, node_id")]
    rows = db.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events ORDER BY id DESC LIMIT ?",
                      (max_events,)).fetchall()
    events = [dict(zip(EVENT_COLUMNS, row, strict=True)) for row in reversed(rows)]
    rows = db.execute(f"SELECT {', '.join(RECOVERY_COLUMNS)} FROM recoveries ORDER BY id DESC LIMIT ?",
                      (-1 if max_recoveries is None else max_recoveries,)).fetchall()  # -1: no limit
    recoveries = [Recovery(*row) for row in reversed(rows)]
    return Snapshot(int(generation[0]) if generation else 0, nodes, events, recoveries)


def _node_values(node: dict[str, Any]) -> tuple:
    row = dict(node, **{c: json.dumps(node.get(c) or {}, sort_keys=True) for c in _JSON_COLUMNS})
    return tuple(int(row[c]) if c in _BOOL_COLUMNS else row[c] for c in NODE_COLUMNS)


def _node_dict(row: dict[str, Any]) -> dict[str, Any]:
    for column in _JSON_COLUMNS:
        row[column] = json.loads(row[column] or "{}")
    for column in _BOOL_COLUMNS:
        row[column] = bool(row[column])
    return row


@contextmanager
def _translated(path: Path) -> Iterator[None]:
    """Turn sqlite3 errors into RegistryErrors that say what to do."""
    try:
        yield
    except sqlite3.Error as error:
        text = str(error).lower()
        if "locked" in text or "busy" in text:
            raise RegistryError(f"{path} is locked by another process; is another coordinator "
                                "using it? Stop it, or pass another --registry") from error
        if isinstance(error, sqlite3.DatabaseError) and ("not a database" in text or "malformed" in text):
            raise RegistryError(_not_a_registry(path)) from error
        raise RegistryError(f"cannot use the cluster registry {path}: {error}") from error


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, taking the write lock up front (waits up to the busy timeout)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
