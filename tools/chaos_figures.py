"""Write the figures of docs/chaos.md from a chaos campaign's JSON (`make chaos`'s
runs/chaos/chaos.json, committed as benchmarks/results/chaos/campaign.json) and from the
JSON of each violated schedule run again after its fix (`disttrain chaos --scenarios S
--seed N --schedules 1 --output benchmarks/results/chaos/rerun_S_N.json`).

    python tools/chaos_figures.py            # the committed files

The figures stand between `<!-- chaos:begin -->` and `<!-- chaos:end -->` in the page's
"Figures" section; tests/unit/test_chaos_figures.py fails while they differ from `render`
of the committed files.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from markers import write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "chaos.md"
RESULTS = REPO_ROOT / "benchmarks" / "results" / "chaos"
BEGIN, END = "<!-- chaos:begin -->\n", "<!-- chaos:end -->\n"
WIDTH = 90  # the docs' line length
OUTCOMES = ("finished", "stopped-then-resumed", "violated")


def _counted(counts: dict[str, int]) -> str:
    ordered = sorted(((k, v) for k, v in counts.items() if v), key=lambda kv: (-kv[1], kv[0]))  # most first
    return ", ".join(f"{name} {count}" for name, count in ordered)


def _accuracies(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{100 * low:.2f}%" if low == high else f"{100 * low:.2f}-{100 * high:.2f}%"


def _reruns(reruns: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["scenario"], r["seed"]): r for summary in reruns for r in summary["results"]}


def render(campaign: dict[str, Any], reruns: list[dict[str, Any]] = ()) -> str:
    """The page's figures (markdown) from a campaign's JSON and the reruns' JSONs."""
    slowdown = campaign["slowdown"]
    recovery = campaign["longest_recovery_s"]
    head = (f"The committed campaign (`benchmarks/results/chaos/campaign.json`): "
            f"`disttrain chaos --schedules {campaign['schedules_run']} --seed {campaign['first_seed']}`, "
            f"{campaign['wall_s'] / 60:.0f} minutes on 2 shared cores. Slowdown against the fault-free "
            + (f"run, over the runs that finished without a stop: median {slowdown['median']:.2f}x, max "
               f"{slowdown['max']:.2f}x. " if slowdown["median"] is not None else "run: none finished. ")
            + "The longest recovery (a failure to the run training again): "
            + (f"{recovery:.1f} s." if recovery is not None else "none recorded."))
    lines = [*textwrap.wrap(head, WIDTH, break_on_hyphens=False), "",
             "| schedules | finished | stopped with a reason, then resumed | invariant violations |",
             "|---|---|---|---|",
             f"| {campaign['schedules_run']} | {campaign['finished']} | {campaign['stopped_with_reason']} "
             f"| {campaign['invariant_violations']} |", "",
             "| scenario | finished | stopped, resumed | violated | fault-free accuracy | fault-free run |",
             "|---|---|---|---|---|---|"]
    for name, counts in campaign["by_scenario"].items():
        reference = campaign["references"].get(name, {"accuracies": [], "wall_s": 0})
        lines.append(f"| `{name}` | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES)
                     + f" | {_accuracies(reference['accuracies'])} | {reference['wall_s']:.1f} s |")
    lines += ["", *textwrap.wrap(f"Patterns drawn: {_counted(campaign['patterns'])}. Faults: "
                                 f"{_counted(campaign['faults'])}.", WIDTH, break_on_hyphens=False)]
    if campaign["violations"]:
        again = _reruns(reruns)
        lines += ["", "Violations found, and the same schedule run again after the fix:", "",
                  "| scenario | seed | schedule | violated | after the fix |", "|---|---|---|---|---|"]
        for v in campaign["violations"]:
            rerun = again.get((v["scenario"], v["seed"]))
            if rerun is None:
                after = "not run again"
            else:
                after = "; ".join(f"violated: {x}" for x in rerun["violations"]) or rerun["outcome"]
            schedule = "<br>".join(f"`{line}`" for line in v["schedule"])
            lines.append(f"| `{v['scenario']}` | {v['seed']} | {schedule} | {'; '.join(v['violations'])} "
                         f"| {after} |")
    return "\n".join(lines) + "\n"


def committed() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The committed campaign and reruns."""
    campaign = json.loads((RESULTS / "campaign.json").read_text())
    reruns = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("rerun_*.json"))]
    return campaign, reruns


def main() -> int:
    if not write_block(PAGE, BEGIN, END, render(*committed())):
        return 1
    print(f"wrote the figures of {RESULTS} into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
