"""The failures of a run and how it recovered from each, for its summary: from the
supervisor (what failed, how, when it was restarted) and the coordinator's registry
(its recovery records: how long the failure took to detect, and until the process was
back at work), and the launcher's own clock of each restarted worker's first step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.coordinator.nodes import Recovery
from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.coordinator.supervisor import Failure
from disttrain.core.processes import PROGRESS_EVENT, Event

logger = logging.getLogger(__name__)

MAX_EVENTS = 10_000


@dataclass
class FirstSteps:
    """How long each restarted worker took from its exit to its first step done again (its
    first push applied and the parameters pulled back), as the launcher hears the steps:
    the time the run is short of that worker. Keyed by the failure's index."""

    clock: Callable[[], float] = time.monotonic
    seconds: dict[int, float] = field(default_factory=dict)

    def saw(self, event: Event, failures: list[Failure]) -> None:
        """Call with each event the launcher reads (after the failures it handled)."""
        if event.kind != PROGRESS_EVENT or "steps" not in event.fields:
            return
        for index, failure in enumerate(failures):
            if failure.name == event.child and failure.restarted_at is not None and index not in self.seconds:
                self.seconds[index] = round(self.clock() - failure.exited_at, 3)


def recovery_summary(failures: list[Failure], registry: Path, first_steps: FirstSteps | None = None
                     ) -> dict[str, Any]:
    """`failures` (one record per failure: process, reason, restart_s, detect_s,
    recover_s, first_step_s), their count, and the processes flagged as stragglers; the coordinator's
    recovery records are matched by process, in order, and left out where the registry
    cannot be read (or the process never came back)."""
    recovered: dict[str, list[Recovery]] = {}
    stragglers: set[str] = set()
    try:
        if registry.exists():
            snapshot = read_status(registry, max_events=MAX_EVENTS)
            for recovery in snapshot.recoveries:
                recovered.setdefault(recovery.node_id, []).append(recovery)
            stragglers = {str(e["node_id"]) for e in snapshot.events if e["kind"] == "straggler"}
    except RegistryError as e:
        logger.warning("recovery times left out of the summary: %s", e)
    rows = []
    for failure in failures:
        row: dict[str, Any] = {"process": failure.name, "reason": failure.reason}
        if failure.restarted_at is not None:
            row["restart_s"] = round(failure.restarted_at - failure.exited_at, 3)
        records = recovered.get(failure.name, [])
        if records:
            record = records.pop(0)
            row.update(detect_s=record.detect_s, recover_s=record.recover_s)
        if first_steps is not None and len(rows) in first_steps.seconds:
            row["first_step_s"] = first_steps.seconds[len(rows)]
        rows.append(row)
    return {"num_failures": len(rows), "failures": rows, "stragglers": sorted(stragglers)}
