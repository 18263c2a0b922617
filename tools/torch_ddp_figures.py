"""Write the figures of the sync PS against a plain torch DDP loop in docs/benchmarks.md
from the workloads benchmark's JSON, committed as benchmarks/results/ps_vs_torch_ddp_1.json,
_2.json and _3.json (the commands are on the page), one column a run:

    python tools/torch_ddp_figures.py            # the committed files

The figures stand between `<!-- torch-ddp:begin -->` and `<!-- torch-ddp:end -->`;
tests/unit/test_torch_ddp_figures.py fails while they differ from `render` of the
committed files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from markers import write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "benchmarks.md"
RESULTS = REPO_ROOT / "benchmarks" / "results"
RUNS = ("ps_vs_torch_ddp_1.json", "ps_vs_torch_ddp_2.json", "ps_vs_torch_ddp_3.json")
BEGIN, END = "<!-- torch-ddp:begin -->\n", "<!-- torch-ddp:end -->\n"
MODELS = {"resnet18": "ResNet-18", "gpt_small": "`gpt_small`"}
STRATEGIES = {"ps_sync": "`ps_sync` (overlap trial)", "ps_sync_no_overlap": "`ps_sync_no_overlap`"}


def render(runs: list[dict[str, Any]]) -> str:
    """The page's table (markdown): a row per model and PS variant, a column per run, each
    cell its samples/s over the plain torch DDP loop's (`ps_vs_ddp`'s `torch_ddp_ratio`)."""
    def heading(number: int, run: dict[str, Any]) -> str:
        steps = {w["steps_per_process"] for w in run["workloads"].values()}
        return f"run {number} ({'/'.join(map(str, sorted(steps)))} steps, {run['repeats']} repeats)"

    headings = " | ".join(heading(i, r) for i, r in enumerate(runs, 1))
    lines = [f"| samples/s over torch DDP's | {headings} |", "|---|" + "---:|" * len(runs)]
    for model, model_name in MODELS.items():
        for strategy, name in STRATEGIES.items():
            cells = [f"{run['ps_vs_ddp'][model][strategy]['torch_ddp_ratio']:.2f}" for run in runs]
            lines.append(f"| {model_name}, {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def committed() -> list[dict[str, Any]]:
    return [json.loads((RESULTS / name).read_text()) for name in RUNS]


def main() -> int:
    if not write_block(PAGE, BEGIN, END, render(committed())):
        return 1
    print(f"wrote the sync PS's figures against torch DDP into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
