"""Hot spares of a parameter-server run (`ps.spares`): worker processes started ahead,
which do their whole start-up (imports, data, model) and wait; when a worker is lost, the
launcher hands one of them the lost worker's identity instead of starting a fresh
process, and the spare resumes from that worker's checkpoint as a restart would.

The hand-off is local: the launcher writes the identity (worker id, rank, attempt and the
worker's node token) to a JSON file of its own log folder, private to its owner and
written atomically, then sends the spare SIGUSR1; the spare, which blocked SIGUSR1 before
it said it was ready, takes the signal with `sigwait`, reads the file and deletes it.
Nothing is unpickled and nothing crosses the network. A spare given no identity is
stopped with the run. After a step-in the launcher starts a new spare in the background,
so the run keeps its count of spares waiting.

The launcher's side is `SpareCluster`: a `Cluster` whose `spawn` of a worker's restart
hands a ready spare the worker's spec (the spare's process takes the worker's name in
the cluster, so its events and exit are the worker's from then on), and starts a plain
process when no spare is ready.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from disttrain.core.atomic_files import write_bytes_atomic
from disttrain.core.auth import TOKEN_ENV
from disttrain.core.errors import ConfigError
from disttrain.core.process_spec import ProcessSpec
from disttrain.core.processes import Child, Cluster, Event, emit_event

logger = logging.getLogger(__name__)

HANDOFF_SIGNAL = signal.SIGUSR1
READY_EVENT = "spare-ready"
WORKER_COMMAND = "ps-worker"


@dataclass(frozen=True)
class Identity:
    """Whom a spare becomes: the lost worker's id, rank, restart attempt and node token."""

    worker_id: str
    rank: int
    attempt: int
    token: str | None


def write_handoff(path: Path, identity: Identity) -> None:
    """Write `identity` to `path` atomically, readable by its owner only."""
    write_bytes_atomic(path, json.dumps(asdict(identity)).encode(), mode=0o600)


def read_handoff(path: Path) -> Identity:
    """The identity at `path` (then deleted). Raises ValueError for a malformed file."""
    fields: Any = json.loads(path.read_text())
    path.unlink(missing_ok=True)
    if not isinstance(fields, dict) or not isinstance(fields.get("worker_id"), str) \
            or not isinstance(fields.get("rank"), int) or not isinstance(fields.get("attempt"), int):
        raise ValueError(f"the hand-off file {path} does not name a worker")
    token = fields.get("token")
    return Identity(fields["worker_id"], fields["rank"], fields["attempt"],
                    token if isinstance(token, str) else None)


class SpareWait:
    """A spare's side. Construct first thing (it blocks the hand-off signal, so one sent
    early waits); call `identity()` once start-up is done: it says the spare is ready and
    blocks until the launcher hands it a worker."""

    def __init__(self, path: Path):
        self.path = Path(path)
        signal.pthread_sigmask(signal.SIG_BLOCK, {HANDOFF_SIGNAL})

    def identity(self) -> Identity:
        """Block until handed a worker; its identity. Raises ValueError for a bad file."""
        emit_event(READY_EVENT)
        logger.info("hot spare ready: waiting to step in for a lost worker")
        while not self.path.exists():  # a stray SIGUSR1 without a file: keep waiting
            signal.sigwait({HANDOFF_SIGNAL})
        identity = read_handoff(self.path)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {HANDOFF_SIGNAL})
        logger.info("hot spare stepping in as %s (rank %d, attempt %d)", identity.worker_id, identity.rank,
                    identity.attempt)
        return identity


def check_spares(num_spares: int, elastic: bool) -> None:
    """Raises ConfigError where spares cannot apply (an elastic run restarts every process
    at each change of size, spares too)."""
    if num_spares and elastic:
        raise ConfigError(f"ps.spares: {num_spares} hot spares are not offered with --workers MIN:MAX (each "
                          "change of size starts every process again through a checkpoint); give --workers N "
                          "or leave --spares out")


class SpareCluster(Cluster):
    """A cluster that keeps `num_spares` spare workers waiting once `start_spares` is called,
    and restarts a lost worker on a ready spare when it can (see the module)."""

    def __init__(self, log_dir: str | Path, num_spares: int, **kwargs: Any):
        super().__init__(log_dir, **kwargs)
        self.num_spares = num_spares
        self.template: ProcessSpec | None = None
        self.waiting: dict[str, bool] = {}  # spare name -> ready
        self.num_started = 0
        self.step_ins: list[dict[str, Any]] = []

    def start_spares(self, template: ProcessSpec) -> None:
        """Start the spares: workers of `template` (its servers and faults) waiting for a name."""
        self.template = template
        for _ in range(self.num_spares):
            self._start_spare()

    def _start_spare(self) -> None:
        assert self.template is not None, "start_spares first"
        name = f"spare{self.num_started}"
        self.num_started += 1
        # Named, so its environment holds a node token of its own name, never the run's secret.
        spec = replace(self.template, worker_id=name, rank=None, attempt=0, resume=False,
                       handoff=self.log_dir / f"{name}.handoff.json")
        super().spawn(name, spec)
        self.waiting[name] = False

    def spawn(self, name: str, spec: ProcessSpec, env: dict[str, str] | None = None) -> Child:
        """A worker's restart on a ready spare, if one is; else a fresh process."""
        ready = next((n for n, ok in self.waiting.items() if ok), None)
        if spec.command != WORKER_COMMAND or spec.attempt == 0 or spec.worker_id is None or ready is None:
            return super().spawn(name, spec, env)
        del self.waiting[ready]
        child = self.children.pop(ready)
        own = self.env_of(spec) if self.env_of is not None else {}
        write_handoff(self.log_dir / f"{ready}.handoff.json",
                      Identity(spec.worker_id, -1 if spec.rank is None else spec.rank, spec.attempt,
                               own.get(TOKEN_ENV)))
        child.name = name  # its events and exit are the worker's from now on
        self.children[name] = child
        os.kill(child.process.pid, HANDOFF_SIGNAL)
        logger.warning("hot spare %s steps in for %s (attempt %d; its log: %s)", ready, name, spec.attempt,
                       child.log_path)
        self.step_ins.append({"slot": name, "spare": ready, "pid": child.process.pid, "attempt": spec.attempt,
                              "at": time.time()})
        self._start_spare()  # in the background: the run keeps its spares
        return child

    def next_event(self, timeout_s: float | None) -> Event | None:
        event = super().next_event(timeout_s)
        if event is not None and event.child in self.waiting:
            if event.kind == READY_EVENT:
                self.waiting[event.child] = True
            elif event.kind == "exit":
                del self.waiting[event.child]
                logger.warning("hot spare %s exited with code %s before stepping in; see %s", event.child,
                               event.fields.get("code"), self.children[event.child].log_path)
        return event

    def summary(self, failures: list[dict[str, Any]]) -> dict[str, Any]:
        """The run summary's spare keys (as live DDP's); marks the rows of `failures` (the
        summary's, in order) a spare stepped in for, and takes each step-in's
        `after_loss_s` (from the worker's exit to its first step done again) from its row."""
        step_ins = []
        for step_in in self.step_ins:
            rows = [row for row in failures if row["process"] == step_in["slot"]]
            row = rows[step_in["attempt"] - 1] if len(rows) >= step_in["attempt"] else {}
            if row:
                row["spare"] = step_in["spare"]
            seconds = {"after_loss_s": row["first_step_s"]} if "first_step_s" in row else {}
            step_ins.append({**step_in, **seconds})
        return {"num_spares": self.num_spares, "num_spares_started": self.num_started,
                "spare_step_ins": step_ins}
