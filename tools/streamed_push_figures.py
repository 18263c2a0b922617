"""Write the figures of the streamed push (buckets finer than a shard) in
docs/benchmarks.md from the workloads benchmark's JSON, committed as
benchmarks/results/ps_streamed_push_before.json (the tree before the streamed push) and
ps_streamed_push.json (after it), both from

    python benchmarks/workloads.py --models resnet18 --strategies ps_sync_overlap,ps_sync_no_overlap \\
        --servers 1 --set ps.payload_transport=grpc --steps 30 --repeats 3

    python tools/streamed_push_figures.py            # the committed files

The figures stand between `<!-- streamed-push:begin -->` and `<!-- streamed-push:end -->`;
tests/unit/test_streamed_push_figures.py fails while they differ from `render` of the
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
FILES = {"before": "ps_streamed_push_before.json", "after": "ps_streamed_push.json"}
BEGIN, END = "<!-- streamed-push:begin -->\n", "<!-- streamed-push:end -->\n"
NAMES = {"before": {"ps_sync_overlap": "overlap (whole shard)", "ps_sync_no_overlap": "plain"},
         "after": {"ps_sync_overlap": "overlap (streamed)", "ps_sync_no_overlap": "plain"}}


def render(results: dict[str, dict[str, Any]]) -> str:
    """The page's table (markdown) from each tree's result, by `FILES`' keys."""
    lines = ["| tree | strategy | step (s) | compute (s) | blocked on comm. (s) | in flight during backward "
             "| samples/s / plain's |", "|---|---|---:|---:|---:|---:|---:|"]
    for tree, result in results.items():
        for model, figures in result["results"].items():
            plain = figures["ps_sync_no_overlap"]
            for strategy, name in NAMES[tree].items():
                f = figures[strategy]
                share = f["overlapped_share"] or 0.0
                lines.append(f"| {tree} ({model}, {result['servers']} shard) | {name} | "
                             f"{f['step_time_s']:.3f} | {f['compute_s']:.3f} | {f['comm_s']:.3f} | "
                             f"{share:.0%} | {f['samples_per_s'] / plain['samples_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def committed() -> dict[str, dict[str, Any]]:
    return {tree: json.loads((RESULTS / name).read_text()) for tree, name in FILES.items()}


def main() -> int:
    if not write_block(PAGE, BEGIN, END, render(committed())):
        return 1
    print(f"wrote the streamed push's figures into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
