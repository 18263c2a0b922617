"""Write the workloads benchmark's tables in docs/benchmarks.md from its committed JSON
(`benchmarks/results/`), each between its markers (`<!-- NAME:begin -->`, `<!-- NAME:end
-->`):

- `streamed-push`: the streamed push (buckets finer than a shard), from
  ps_streamed_push_before.json (the tree before it) and ps_streamed_push.json (after it),
  both from

      python benchmarks/workloads.py --models resnet18 --strategies ps_sync_overlap,ps_sync_no_overlap \\
          --servers 1 --set ps.payload_transport=grpc --steps 30 --repeats 3

- `torch-ddp`: the sync PS against a plain torch DDP loop, from ps_vs_torch_ddp_1.json,
  _2.json and _3.json (the commands are on the page), one column a run.

    python tools/workloads_figures.py            # the committed files

tests/unit/test_workloads_figures.py fails while a table differs from its `render` of the
committed files.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from markers import write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "benchmarks.md"
RESULTS = REPO_ROOT / "benchmarks" / "results"
STREAMED_FILES = {"before": "ps_streamed_push_before.json", "after": "ps_streamed_push.json"}
STREAMED_NAMES = {"before": {"ps_sync_overlap": "overlap (whole shard)", "ps_sync_no_overlap": "plain"},
                  "after": {"ps_sync_overlap": "overlap (streamed)", "ps_sync_no_overlap": "plain"}}
TORCH_DDP_RUNS = ("ps_vs_torch_ddp_1.json", "ps_vs_torch_ddp_2.json", "ps_vs_torch_ddp_3.json")
MODELS = {"resnet18": "ResNet-18", "gpt_small": "`gpt_small`"}
STRATEGIES = {"ps_sync": "`ps_sync` (overlap trial)", "ps_sync_no_overlap": "`ps_sync_no_overlap`"}


def markers(name: str) -> tuple[str, str]:
    """The lines a table stands between."""
    return f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->\n"


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def render_streamed_push(results: dict[str, dict[str, Any]]) -> str:
    """The streamed push's table (markdown) from each tree's result, by `STREAMED_FILES`' keys."""
    lines = ["| tree | strategy | step (s) | compute (s) | blocked on comm. (s) | in flight during backward "
             "| samples/s / plain's |", "|---|---|---:|---:|---:|---:|---:|"]
    for tree, result in results.items():
        for model, figures in result["results"].items():
            plain = figures["ps_sync_no_overlap"]
            for strategy, name in STREAMED_NAMES[tree].items():
                f = figures[strategy]
                share = f["overlapped_share"] or 0.0
                lines.append(f"| {tree} ({model}, {result['servers']} shard) | {name} | "
                             f"{f['step_time_s']:.3f} | {f['compute_s']:.3f} | {f['comm_s']:.3f} | "
                             f"{share:.0%} | {f['samples_per_s'] / plain['samples_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def render_torch_ddp(runs: list[dict[str, Any]]) -> str:
    """The torch DDP table (markdown): a row per model and PS variant, a column per run, each
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


# Each table: its markers' name -> (render, the committed JSON it renders).
TABLES: dict[str, tuple[Callable[[Any], str], Callable[[], Any]]] = {
    "streamed-push": (render_streamed_push,
                      lambda: {tree: load(name) for tree, name in STREAMED_FILES.items()}),
    "torch-ddp": (render_torch_ddp, lambda: [load(name) for name in TORCH_DDP_RUNS]),
}


def main() -> int:
    for name, (render, committed) in TABLES.items():
        if not write_block(PAGE, *markers(name), render(committed())):
            return 1
    print(f"wrote the workloads benchmark's tables ({', '.join(TABLES)}) into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
