"""Many schedules in a row, and the JSON that sums them up.

Schedule `i` of a campaign from seed `s` runs scenario `scenarios[i % len(scenarios)]`
with seed `s + i`, so a campaign reproduces from its first seed and any one schedule from
its own (`disttrain chaos --scenarios NAME --seed SEED --schedules 1`).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.chaos.runner import Reference, reference, run_schedule
from disttrain.chaos.scenarios import Scenario
from disttrain.chaos.schedule import draw


@dataclass(frozen=True)
class Campaign:
    """Which schedules a campaign runs: `count` of them over `scenarios`, from `first_seed`,
    each of 1 to `max_patterns` patterns."""

    scenarios: tuple[Scenario, ...]
    first_seed: int
    count: int
    max_patterns: int = 2


def run_campaign(campaign: Campaign, work_dir: Path,
                 on_result: Callable[[dict[str, Any]], None] = lambda result: None,
                 keep: bool = False) -> dict[str, Any]:
    """Run the schedules of `campaign` (their runs under `work_dir`, kept with `keep`;
    `on_result` told of each); the campaign's JSON (see `summarize`).

    Raises:
        RuntimeError: a scenario's fault-free run failed (nothing to compare against).
    """
    scenarios, first_seed, count, max_patterns = (campaign.scenarios, campaign.first_seed, campaign.count,
                                                  campaign.max_patterns)
    started = time.monotonic()
    references: dict[str, Reference] = {}
    results = []
    for i in range(count):
        scenario = scenarios[i % len(scenarios)]
        if scenario.name not in references:
            references[scenario.name] = reference(scenario, work_dir)
        schedule = draw(scenario, first_seed + i, max_patterns)
        result = run_schedule(scenario, schedule, work_dir, references[scenario.name], keep)
        results.append(result)
        on_result(result)
    summary = summarize(results, references)
    summary["first_seed"], summary["wall_s"] = first_seed, round(time.monotonic() - started, 1)
    return summary


PREEMPTION_LINE = "preempt at step"  # how a schedule prints a preemption
RESIZE_LINE = "resize at step"  # and an elastic run's change of size


def summarize(results: list[dict[str, Any]], references: dict[str, Reference]) -> dict[str, Any]:
    """Counts (run, finished, stopped then resumed, violated), the slowdown against the
    fault-free runs, the longest recovery, the patterns and faults drawn, the preemptions
    (drawn, sent, launches they stopped with exit 143, launches that ended within the
    grace instead, runs resumed on another size), every violation with its schedule, and
    every result."""
    outcomes = Counter(r["outcome"] for r in results)
    slowdowns = [r["slowdown"] for r in results if r["exit_code"] == 0]
    recoveries = [r["longest_recovery_s"] for r in results if r.get("longest_recovery_s")]
    lines = [line for r in results for line in r["schedule"]]
    preemptions = [line for line in lines if line.startswith(PREEMPTION_LINE)]
    resizes = [line for line in lines if line.startswith(RESIZE_LINE)]
    faults = Counter(line.split(":")[0] for line in lines if "from outside" not in line)
    faults["kill from outside"] = sum(1 for line in lines if "from outside" in line) - len(preemptions) \
        - len(resizes)
    if preemptions:
        faults["preemption"] = len(preemptions)
    for line in resizes:  # a live group's rank killed from outside is counted as such above
        if "(live recovery)" not in line:
            faults["grow" if "(grow)" in line else "planned leave"] += 1
    faults["kill from outside"] += sum(1 for line in resizes if "(live recovery)" in line)
    launches = [launch for r in results for launch in r.get("launches", [])]
    return {
        "schedules_run": len(results),
        "finished": outcomes["finished"],
        "stopped_with_reason": outcomes["stopped-then-resumed"],
        "invariant_violations": outcomes["violated"],
        "slowdown": {"median": statistics.median(slowdowns) if slowdowns else None,
                     "max": max(slowdowns, default=None)},
        "longest_recovery_s": max(recoveries, default=None),
        "by_scenario": {name: dict(Counter(r["outcome"] for r in results if r["scenario"] == name))
                        for name in dict.fromkeys(r["scenario"] for r in results)},
        "patterns": dict(Counter(p for r in results for p in r["patterns"])),
        "preemptions": {"drawn": len(preemptions),
                        "sent": sum(len(r.get("preemptions_sent", [])) for r in results),
                        "launches_stopped": sum(1 for launch in launches
                                                if launch["preempted"] and launch["exit_code"] == 143),
                        "ended_within_grace": sum(1 for launch in launches
                                                  if launch["preempted"] and launch["exit_code"] == 0),
                        "runs_resized": sum(1 for r in results if _resized(r))},
        "faults": dict(faults),
        "references": {name: {"accuracies": ref.accuracies, "wall_s": round(ref.wall_s, 2)}
                       for name, ref in references.items()},
        "violations": [{"scenario": r["scenario"], "seed": r["seed"], "violations": r["violations"],
                        "schedule": r["schedule"]} for r in results if r["violations"]],
        "results": results,
    }


def _resized(result: dict[str, Any]) -> bool:
    """Whether a run's launches did not all have one number of workers (ranks), or an
    elastic run changed size while it ran (`sizes`)."""
    sizes = result.get("sizes") or [launch["workers"] for launch in result.get("launches", [])]
    return len(set(sizes)) > 1
