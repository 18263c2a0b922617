"""The failures of a run and how it recovered from each, for its summary: from the
supervisor (what failed, how, when it was restarted) and the coordinator's registry
(its recovery records: how long the failure took to detect, and until the process was
back at work)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from disttrain.coordinator.nodes import Recovery
from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.coordinator.supervisor import Failure

logger = logging.getLogger(__name__)

MAX_EVENTS = 10_000


def recovery_summary(failures: list[Failure], registry: Path) -> dict[str, Any]:
    """`failures` (one record per failure: process, reason, restart_s, detect_s,
    recover_s), their count, and the processes flagged as stragglers; the coordinator's
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
        rows.append(row)
    return {"num_failures": len(rows), "failures": rows, "stragglers": sorted(stragglers)}
