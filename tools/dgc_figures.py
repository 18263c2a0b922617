"""Write the DGC figures of docs/compression.md from the compression benchmark's JSON
(`benchmarks/compression.py --dgc`), committed as benchmarks/results/compression_dgc_*.json
(one file per invocation: the parameter server's sync runs, its async runs).

    python tools/dgc_figures.py            # the committed files

The figures stand between `<!-- dgc:begin -->` and `<!-- dgc:end -->` in the page's
"DGC's rules on MNIST" section; tests/unit/test_dgc_figures.py fails while they differ
from `render` of the committed files.
"""

from __future__ import annotations

import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from markers import write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "compression.md"
RESULTS = REPO_ROOT / "benchmarks" / "results"
PATTERN = "compression_dgc_*.json"
BEGIN, END = "<!-- dgc:begin -->\n", "<!-- dgc:end -->\n"
WIDTH = 90  # the docs' line length
# compressed run -> (its dense run, the row's label)
PAIRS = {"ps-sync-dgc": ("ps-sync", "PS sync"), "ps-async-dgc": ("ps-async", "PS async"),
         "ddp-dgc": ("ddp", "DDP")}


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f} MB"


def _fewer(dense: float | None, sent: float | None) -> str:
    return "-" if not dense or not sent else f"{dense / sent:.0f}x"


def _rows(result: dict[str, Any]) -> list[str]:
    """One row per seed and one of their means, for each DGC run of `result`."""
    rows = []
    for name, (against, label) in PAIRS.items():
        runs = result["runs"]
        if name not in runs or against not in runs:
            continue
        dense = {r["seed"]: r for r in runs[against]["runs"]}
        for run in runs[name]["runs"]:
            base = dense.get(run["seed"])
            if base is None:
                continue
            gap = 100 * (base["accuracy"] - run["accuracy"])
            rows.append(f"| {label} | {run['seed']} | {100 * base['accuracy']:.2f}% | "
                        f"{100 * run['accuracy']:.2f}% | {gap:+.2f} | "
                        f"{_megabytes(base['wire_bytes_sent'])} | "
                        f"{_megabytes(run['wire_bytes_sent'])} | "
                        f"{_fewer(base['wire_bytes_sent'], run['wire_bytes_sent'])} | "
                        f"{run['compression_ratio']:.0f}x |")
        check = result["checks"].get(name)
        if check is not None:
            payload = statistics.mean(r["compression_ratio"] for r in runs[name]["runs"])
            wire = check.get("wire_share_of_dense")
            rows.append(f"| **{label}, mean** | | {100 * runs[against]['accuracy']:.2f}% | "
                        f"{100 * runs[name]['accuracy']:.2f}% | {check['mean_accuracy_drop_points']:+.2f} | "
                        f"{_megabytes(runs[against].get('wire_bytes_sent'))} | "
                        f"{_megabytes(runs[name].get('wire_bytes_sent'))} | "
                        f"{'-' if not wire else f'{1 / wire:.0f}x'} | {payload:.0f}x |")
    return rows


def render(results: list[tuple[str, dict[str, Any]]]) -> str:
    """The page's DGC figures (markdown) from the benchmark's JSONs (each with the path it
    was written to, relative to the repository), in the order given."""
    lines = ["| run | seed | dense accuracy | DGC accuracy | dense - DGC (points) | pushes, dense | "
             "pushes, DGC | fewer bytes on the wire | fewer payload bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    commands, verdicts = [], []
    for path, result in results:
        lines += _rows(result)
        seeds = ",".join(str(seed) for seed in result["seeds"])
        commands.append(f"python benchmarks/compression.py --dgc --seeds {seeds} "
                        f"--only {','.join(result['runs'])} --output {path}")
        for name, check in result["checks"].items():
            verdicts.append(f"{PAIRS.get(name, (None, name))[1]}: "
                            f"{'met' if check['met'] else 'missed'} ({check['fewer_bytes_x']:.0f}x fewer "
                            f"bytes, {check['mean_accuracy_drop_points']:+.2f} points)")
    verdict = ("Target (>= 100x fewer bytes, mean accuracy within 0.5 points of dense): "
               + "; ".join(verdicts) + ".")
    return ("```\n" + "\n".join(commands) + "\n```\n\n" + "\n".join(lines) + "\n\n"
            + "\n".join(textwrap.wrap(verdict, WIDTH, break_on_hyphens=False)) + "\n")


def committed() -> list[tuple[str, dict[str, Any]]]:
    """The committed results with their paths, sync before async."""
    paths = sorted(RESULTS.glob(PATTERN), key=lambda p: ("async" in p.stem, p.stem))
    return [(str(path.relative_to(REPO_ROOT)), json.loads(path.read_text())) for path in paths]


def main() -> int:
    if not write_block(PAGE, BEGIN, END, render(committed())):
        return 1
    print(f"wrote the DGC figures of {RESULTS / PATTERN} into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
