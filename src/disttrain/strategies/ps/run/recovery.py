"""The failures of a run and how it recovered from each, for its summary: from the
supervisor (what failed, how, when it was restarted) and the coordinator's registry
(how long the failure took to detect, and until the process was back at work)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from disttrain.coordinator.registry import RegistryError, read_status
from disttrain.coordinator.supervisor import Failure

logger = logging.getLogger(__name__)

_FIGURE = re.compile(r"\b(detect_s|recover_s)=([0-9.]+)")
MAX_EVENTS = 10_000


def recovery_summary(failures: list[Failure], registry: Path) -> dict[str, Any]:
    """`failures` (one record per failure: process, reason, restart_s, detect_s,
    recover_s), their count, and the processes flagged as stragglers; the figures of the
    coordinator are matched by process, in order, and absent where the registry cannot
    be read."""
    recovered: dict[str, list[dict[str, float]]] = {}
    stragglers: set[str] = set()
    try:
        for event in read_status(registry, max_events=MAX_EVENTS).events if registry.exists() else []:
            if event["kind"] == "recovered":
                figures = {k: float(v) for k, v in _FIGURE.findall(str(event["detail"]))}
                recovered.setdefault(str(event["node_id"]), []).append(figures)
            elif event["kind"] == "straggler":
                stragglers.add(str(event["node_id"]))
    except RegistryError as e:
        logger.warning("recovery times left out of the summary: %s", e)
    rows = []
    for failure in failures:
        row: dict[str, Any] = {"process": failure.name, "reason": failure.reason}
        if failure.restarted_at is not None:
            row["restart_s"] = round(failure.restarted_at - failure.exited_at, 3)
        figures = recovered.get(failure.name, [])
        if figures:
            row.update(figures.pop(0))
        rows.append(row)
    return {"num_failures": len(rows), "failures": rows, "stragglers": sorted(stragglers)}
