"""Preemption of a whole parameter-server run on this machine, as its launcher sees it.

A scheduler reclaiming the machine signals the job's main process, the launcher
(`disttrain ps`); a worker may also be signalled alone (its machine reclaimed, or the
fault `term:worker=N:step=S`), which it tells the launcher (`preemption.PREEMPTING_EVENT`),
as does its exit with `Preempted`'s code. Either way the run stops as a whole: one worker
of a synchronous run cannot leave while the others wait for its pushes, and a worker
preempted is a planned stop, never a failure to restart. The launcher forwards SIGTERM to
every worker, which stop at one step they agree on with their checkpoints (see
`worker.preemption`), then, once they have exited, to the shards, which write a checkpoint
of their version as they stop, then to the coordinator; all within
`system.preemption_grace_s`, past which what is left is killed. It exits with `Preempted`
(code 143) and one line naming the step of the checkpoints (or the newest of each
process), to be resumed with `--resume`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from disttrain.core import checkpoint as ckpt
from disttrain.core import object_store
from disttrain.core.errors import CheckpointError, Preempted
from disttrain.core.processes import Cluster, Event
from disttrain.strategies.ps.worker.preemption import PREEMPTING_EVENT

logger = logging.getLogger(__name__)

PREEMPT_EVENT = "preempt"  # the launcher's own SIGTERM, as an event of its cluster's queue
LAUNCHER = "launcher"
GRACE_KEY = "system.preemption_grace_s"
MIN_SHARD_STOP_S = 5.0  # the shards' stop (a checkpoint write) even when the workers took the grace


def sigterm_preempts(cluster: Cluster) -> None:
    """From now on, SIGTERM to this process (the main thread's handler) becomes a
    `PREEMPT_EVENT` in `cluster`'s queue, for the launcher's loop to act on; a second one
    ends the launcher at once (its children are killed as it leaves the cluster)."""
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if received:
            raise SystemExit(128 + signum)
        received.append(signum)
        # Put from another thread: the main thread may hold the queue's lock right now.
        threading.Thread(target=cluster.events.put, args=(Event(LAUNCHER, PREEMPT_EVENT, {}),),
                         daemon=True).start()

    signal.signal(signal.SIGTERM, handler)


def preemption(event: Event) -> str | None:
    """Why `event` preempts the run (SIGTERM to the launcher, to a worker, or a worker's
    exit with `Preempted`'s code: a planned stop, never restarted), or None."""
    if event.kind == PREEMPT_EVENT:
        return "SIGTERM"
    if not event.child.startswith("worker"):
        return None
    if event.kind == PREEMPTING_EVENT:
        return f"{event.child} was sent SIGTERM"
    if event.kind == "exit" and event.fields.get("code") == Preempted.exit_code:
        return f"{event.child} stopped, preempted"
    return None


def stop_in_order(cluster: Cluster, groups: Sequence[Sequence[str]], grace_s: float, reason: str) -> None:
    """SIGTERM each group of children in turn (the workers, then the shards, then the
    coordinator), waiting for a group to exit before the next; a child still running when
    the grace has passed (or, for the groups after the first, `MIN_SHARD_STOP_S` after
    their signal at the latest) is killed."""
    logger.warning("%s: stopping the workers at a step they agree on, each with its checkpoint, then the "
                   "shards with theirs, within %gs (%s)", reason, grace_s, GRACE_KEY)
    deadline = time.monotonic() + grace_s
    for index, group in enumerate(groups):
        for name in _running(cluster, group):
            _signal(cluster, name, signal.SIGTERM, group=False)  # the process, not its loader workers
        until = deadline if index == 0 else max(deadline, time.monotonic() + MIN_SHARD_STOP_S)
        while _running(cluster, group):
            left_s = until - time.monotonic()
            if left_s <= 0 or cluster.next_event(left_s) is None:
                for name in _running(cluster, group):
                    logger.warning("%s did not stop within the preemption grace; killing it", name)
                    _signal(cluster, name, signal.SIGKILL, group=True)
                    cluster.children[name].process.wait()


def _running(cluster: Cluster, names: Sequence[str]) -> list[str]:
    return [n for n in names if n in cluster.children and cluster.children[n].process.poll() is None]


def _signal(cluster: Cluster, name: str, signum: int, group: bool) -> None:
    pid = cluster.children[name].process.pid
    try:
        os.killpg(pid, signum) if group else os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def preempted(checkpoint_dir: str | Path, names: Sequence[str]) -> Preempted:
    """The launcher's error: the step of the checkpoints of `names` (the workers and
    shards: their folders in `checkpoint_dir`), one when they agree, else each one's newest."""
    newest: dict[str, int | None] = {name: _newest_step(object_store.join(checkpoint_dir, name))
                                     for name in names}
    steps = set(newest.values())
    if len(steps) == 1 and None not in steps:
        (step,) = steps
        where = f"checkpoints written at step {step} ({ckpt.checkpoint_name(step)} of every worker and shard)"
    else:
        by_step: dict[int | None, list[str]] = {}
        for name, step in newest.items():
            by_step.setdefault(step, []).append(name)
        where = "the newest checkpoints are " + ", ".join(
            f"{'none' if step is None else f'step {step}'} ({', '.join(group)})"
            for step, group in sorted(by_step.items(), key=lambda item: -1 if item[0] is None else item[0]))
    return Preempted(f"preempted by SIGTERM: {where}; run the same command with --resume to go on")


def _newest_step(folder: str | Path) -> int | None:
    try:
        found = ckpt.list_checkpoints(folder)
    except (OSError, CheckpointError):
        return None
    return max((ckpt.checkpoint_step(path) for path in found), default=None)
