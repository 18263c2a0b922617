"""Write the slow-link figures of Streaming DiLoCo in docs/local-updates.md from the
slow-link benchmark's JSON (`benchmarks/slow_link.py --seed S`), committed as
benchmarks/results/slow_link_streaming_seed*.json (one file per seed: plain local updates
and Streaming DiLoCo at the same H, on each transport).

    python tools/streaming_figures.py            # the committed files

The figures stand between `<!-- streaming-slow-link:begin -->` and
`<!-- streaming-slow-link:end -->` in the page's "Streaming DiLoCo" section;
tests/unit/test_streaming_figures.py fails while they differ from `render` of the
committed files.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from markers import write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "local-updates.md"
RESULTS = REPO_ROOT / "benchmarks" / "results"
PATTERN = "slow_link_streaming_seed*.json"
BEGIN, END = "<!-- streaming-slow-link:begin -->\n", "<!-- streaming-slow-link:end -->\n"
WIDTH = 90  # the docs' line length
STREAMING = re.compile(r"^(?P<plain>.+)\+stream(?P<fragments>\d+)$")  # e.g. ddp+local32+stream4


def pairs(names: list[str]) -> list[tuple[str, str, int]]:
    """(plain configuration, its streaming one, fragments) for each `<plain>+stream<F>` of
    `names` whose plain configuration is there too, in the order of `names`."""
    found = []
    for name in names:
        match = STREAMING.match(name)
        if match and match["plain"] in names:
            found.append((match["plain"], name, int(match["fragments"])))
    return found


def _runs(results: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Each configuration's runs that ended, by seed, over every rate of every result."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for result in results:
        for by_name in result["rates"].values():
            for name, run in by_name.items():
                if run["status"] == "ok":
                    runs.setdefault(name, {})[result["seed"]] = run
    return runs


def _row(name: str, seed: int, run: dict[str, Any], peak_against: int | None) -> str:
    peak = run["exchange_bytes"]["peak"]
    fewer = f" ({peak_against / peak:.1f}x less)" if peak_against and peak else ""
    return (f"| {name} | {seed} | {100 * run['final_accuracy']:.2f}% | {run['final_loss']:.4f} | "
            f"{f'{peak:,} B' if peak else 'none'}{fewer} | {run['exchange_bytes']['epoch_end']:,} B | "
            f"{100 * run['comm_blocked_share']:.1f}% | {run['samples_per_s']:,.0f} | "
            f"{run['bytes_sent'] / 1e6:,.1f} |")


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def verdicts(runs: dict[str, dict[int, dict[str, Any]]], plain: str, streaming: str, fragments: int
             ) -> list[str]:
    """Whether `streaming` matched `plain` over their common seeds: the mean accuracy and loss
    against the spread of `plain`'s own seeds (seed noise), and the peak bytes' cut against F."""
    seeds = sorted(set(runs[plain]) & set(runs[streaming]))
    if not seeds:
        return []
    base, ours = [runs[plain][s] for s in seeds], [runs[streaming][s] for s in seeds]
    lines = []
    for figure, scale, form in (("accuracy", 100, "{:+.2f} points"), ("loss", 1, "{:+.4f}")):
        key = f"final_{figure}"
        gap = scale * (statistics.mean(r[key] for r in ours) - statistics.mean(r[key] for r in base))
        noise = scale * _spread([r[key] for r in base])
        within = "within" if len(seeds) > 1 and abs(gap) <= noise else "not shown within"
        lines.append(f"{figure} {form.format(gap)} on average, {within} the "
                     f"{form.format(noise).lstrip('+')} between {plain}'s seeds")
    cuts = [b["exchange_bytes"]["peak"] / o["exchange_bytes"]["peak"] for b, o in zip(base, ours, strict=True)
            if b["exchange_bytes"]["peak"] and o["exchange_bytes"]["peak"]]
    if cuts:
        near = "about F" if all(abs(cut - fragments) <= 0.1 * fragments for cut in cuts) else "not F"
        lines.append(f"peak bytes per exchange {min(cuts):.1f}x to {max(cuts):.1f}x less "
                     f"({near} = {fragments})")
    blocked = [(100 * b["comm_blocked_share"], 100 * o["comm_blocked_share"])
               for b, o in zip(base, ours, strict=True)]
    lines.append("blocked in exchanges " + ", ".join(f"{o:.1f}% against {b:.1f}%" for b, o in blocked)
                 + " of the step")
    return [f"{streaming} against {plain} (seeds {', '.join(map(str, seeds))}): " + "; ".join(lines) + "."]


def render(results: list[tuple[str, dict[str, Any]]]) -> str:
    """The page's figures (markdown) from the benchmark's JSONs (each with the path it was
    written to, relative to the repository), in the order given."""
    documents = [result for _, result in results]
    runs = _runs(documents)
    names = list(runs)
    lines = ["| configuration | seed | final accuracy | final loss | largest exchange inside the epoch | "
             "epoch's last step | blocked in exchanges | samples/s | MB sent |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    paired = pairs(names)
    for plain, streaming, _ in paired:
        for seed in sorted(runs[plain]):
            lines.append(_row(plain, seed, runs[plain][seed], None))
            if seed in runs[streaming]:
                whole = runs[plain][seed]["exchange_bytes"]["peak"]
                lines.append(_row(streaming, seed, runs[streaming][seed], whole))
    commands = [f"python benchmarks/slow_link.py --rates {','.join(result['rates'])} --seed {result['seed']} "
                f"--configs {','.join(next(iter(result['rates'].values())))} --output {path}"
                for path, result in results]
    said = [line for plain, streaming, fragments in paired
            for line in verdicts(runs, plain, streaming, fragments)]
    text = "\n\n".join(textwrap.fill(line, WIDTH, break_on_hyphens=False) for line in said)
    return ("```\n" + "\n".join(commands) + "\n```\n\n" + "\n".join(lines) + "\n\n" + text + "\n")


def committed() -> list[tuple[str, dict[str, Any]]]:
    """The committed results with their paths, in name order."""
    return [(str(path.relative_to(REPO_ROOT)), json.loads(path.read_text()))
            for path in sorted(RESULTS.glob(PATTERN))]


def main() -> int:
    if not write_block(PAGE, BEGIN, END, render(committed())):
        return 1
    print(f"wrote the slow-link figures of {RESULTS / PATTERN} into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
