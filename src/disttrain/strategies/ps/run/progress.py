"""The progress of a whole parameter-server run: each worker tells it as event lines
(`EventProgress`: its plan of steps, then one line per step), and the launcher shows one
display for the cluster (`ClusterWatch`; the servers' progress lines, which carry only
their version for the supervisor, are not shown)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.core.processes import PROGRESS_EVENT, Event, emit_event
from disttrain.metrics.progress import Progress


class EventProgress:
    """Progress told to the launcher as event lines (it shows one display for all)."""

    def __init__(self, rank: int, total: int, done: int):
        self.rank, self.step = rank, done
        emit_event("plan", rank=rank, total_steps=total, done_steps=done)

    def update(self, n: int = 1, **postfix: float) -> None:
        # `point`, the step reached, is what the supervisor's restart budget reads.
        self.step += n
        emit_event(PROGRESS_EVENT, rank=self.rank, steps=n, loss=round(postfix.get("loss", 0.0), 4),
                   point=self.step)

    def close(self) -> None:
        """Nothing to close: the launcher's display ends with the run."""



@dataclass
class ClusterWatch:
    """The progress display of the whole cluster, fed by the workers' event lines."""

    num_workers: int
    description: str

    def __post_init__(self) -> None:
        self.plans: dict[str, int] = {}
        self.steps, self.workers_left, self.progress = 0, self.num_workers, None

    def saw(self, event: Event) -> None:
        if event.kind == "plan" and event.child not in self.plans:  # a restarted worker plans again
            self.plans[event.child] = int(event.fields["total_steps"])
            self.steps += int(event.fields.get("done_steps", 0))
            if len(self.plans) == self.num_workers:
                self.progress = Progress(sum(self.plans.values()), self.description, initial=self.steps)
        elif event.kind == PROGRESS_EVENT and "steps" in event.fields and self.progress is not None:
            self.progress.update(1, loss=float(event.fields.get("loss", 0.0)))

    def worker_done(self) -> bool:
        """Count a worker done; True when it was the last."""
        self.workers_left -= 1
        return self.workers_left == 0

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
