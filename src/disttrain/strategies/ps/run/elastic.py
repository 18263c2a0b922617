"""A parameter-server run that shrinks and grows while it trains (`disttrain ps --workers
MIN:MAX`: `system.num_workers` MIN, `ps.max_workers` MAX), by restarting its processes
through a checkpoint, as torchrun, Horovod and Ray Train do.

It starts on MIN workers. A change of size is a preemption the launcher goes on from by
itself: the run stops as a whole at a step its workers agree on, each process with its
checkpoint (`run.preemption`), the launcher rewrites the checkpoints for the new number of
workers (`run.resize`: the global batch kept, the epoch's remaining samples re-split, the
ledger renumbered) and starts every process again on them.

- A planned leave: SIGTERM to one worker (its machine reclaimed) shrinks the run by one,
  as long as MIN workers remain; below MIN the run stops with exit 143, as a fixed run
  does. SIGTERM to the launcher stops the whole run (exit 143) whatever the size.
- A grow: SIGUSR1 to the launcher adds one worker, up to MAX (at MAX it is ignored, with a
  warning).

Each change is said in the launcher's log: who asked, the new size, and (from the
rewrite) the per-worker batch and the samples of the epoch still owed. The resumed run's
faults (`--inject`) of workers at steps already passed are dropped, so a fault fires once
in the run, not once per size.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import ConfigError, Preempted
from disttrain.core.fault_spec import Fault
from disttrain.core.processes import Cluster, Event
from disttrain.strategies.ps.run.preemption import LAUNCHER
from disttrain.strategies.ps.run.resize import refusals
from disttrain.strategies.ps.worker.preemption import PREEMPTING_EVENT

logger = logging.getLogger(__name__)

GROW_EVENT = "grow"  # the launcher's SIGUSR1, as an event of its cluster's queue
GROW_SIGNAL = signal.SIGUSR1


class SizeChange(Exception):  # noqa: N818 (a control-flow signal of the launcher, not an error)
    """The run stopped with its checkpoints to go on with `size` workers (`reason`)."""

    def __init__(self, size: int, reason: str):
        super().__init__(reason)
        self.size = size
        self.reason = reason


@dataclass(frozen=True)
class Range:
    """The sizes an elastic run may take: MIN to MAX workers."""

    minimum: int
    maximum: int

    @classmethod
    def of(cls, config: Config) -> Range | None:
        """The run's range; None for a run of a fixed size (`ps.max_workers` 0)."""
        if not config.ps.max_workers:
            return None
        return cls(config.system.num_workers, config.ps.max_workers)

    def change(self, event: Event, size: int) -> tuple[int, str] | None:
        """The size `event` asks for on a run of `size` workers and why; None when it is
        no change of size (a preemption of the whole run, or no request at all)."""
        if event.kind == GROW_EVENT:
            if size >= self.maximum:
                logger.warning("SIGUSR1: the run is at its most workers (%d, ps.max_workers); not growing",
                               self.maximum)
                return None
            return size + 1, f"SIGUSR1: growing from {size} to {size + 1} workers"
        preempted = event.kind == PREEMPTING_EVENT or (
            event.kind == "exit" and event.fields.get("code") == Preempted.exit_code)
        if event.child.startswith("worker") and preempted:
            if size - 1 < self.minimum:
                return None  # a preemption: the run stops with exit 143
            return size - 1, f"{event.child} was sent SIGTERM: a planned leave, {size} to {size - 1} workers"
        return None


def check_elastic(config: Config) -> None:
    """Raises ConfigError for an elastic run with state the resize cannot carry over."""
    reasons = refusals(config)
    if reasons:
        raise ConfigError(f"ps.max_workers: a run that grows and shrinks (--workers MIN:MAX) is offered "
                          f"without compression, local updates, balance or backup workers, and this run has "
                          f"{', '.join(reasons)}; give --workers N")


def grow_on_sigusr1(cluster: Cluster) -> None:
    """From now on, SIGUSR1 to this process becomes a `GROW_EVENT` in `cluster`'s queue."""

    def handler(signum: int, frame: object) -> None:
        # Put from another thread: the main thread may hold the queue's lock right now.
        threading.Thread(target=cluster.events.put, args=(Event(LAUNCHER, GROW_EVENT, {}),),
                         daemon=True).start()

    signal.signal(GROW_SIGNAL, handler)


def ignore_grow_requests() -> None:
    """Between two launches (and before the first) a SIGUSR1 asks for nothing: without
    this, its default action would end the launcher."""
    signal.signal(GROW_SIGNAL, lambda signum, frame: logger.warning(
        "SIGUSR1 while the run changes size or starts: ignored; send it again once the run trains"))


def stop_step(checkpoint_dir: str, num_workers: int) -> int:
    """The step the run's `num_workers` workers stopped at: the lowest of their newest
    checkpoints' (-1: one has none)."""
    steps = [max((ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(object_store.join(checkpoint_dir,
                                                                                          f"worker{rank}"))),
                 default=-1) for rank in range(num_workers)]
    return min(steps)


def faults_after(faults: list[Fault], step: int) -> list[Fault]:
    """`faults` less those of workers at a step the run has passed (they fired)."""
    return [f for f in faults if f.role != "worker" or f.step > step]

