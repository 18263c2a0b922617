"""Rendering a comparison folder: from its comparison.json and the run folders it names
to report.json, report.md, report.html and plots/*.png in the same folder.

comparison.json (written by `disttrain compare`) lists the runs: name, strategy,
compression, workers, status (ok, failed, pending), error, log_dir (relative to the
folder), wall_time_s, command; and the accuracy thresholds and perplexity targets to time
(a language model's runs are timed to the perplexities, others to the accuracies). A finished run is
read from its log_dir; one that failed or is still pending appears in the table with its
status and error, and in no plot. Rendering again replaces every file it writes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.core.errors import InputFileError
from disttrain.metrics.time_to_target import ACCURACY, PERPLEXITY
from disttrain.report.advice import AdviceSection, Advisor, advice_html, advice_markdown, draw_advice
from disttrain.report.figures import (
    OK,
    STATUSES,
    add_speedups,
    rankings,
    run_row,
)
from disttrain.report.files import read_json_file, write_file_atomic, write_json_atomic
from disttrain.report.html import ReportBody, html_page
from disttrain.report.plots import draw_plots, run_colors
from disttrain.report.runs import is_number, load_run
from disttrain.report.table import language_models, legend, markdown_table, ranking_lines, text_table

COMPARISON_FILE = "comparison.json"
REPORT_JSON, REPORT_MARKDOWN, REPORT_HTML = "report.json", "report.md", "report.html"
PLOTS_FOLDER = "plots"
REPORT_VERSION = 1


@dataclass(frozen=True)
class RenderedReport:
    """What `render_comparison` wrote, and the table to print."""

    table: str
    html_path: Path
    json_path: Path
    markdown_path: Path
    plots: list[Path]


def render_comparison(folder: str | Path, advisor: Advisor | None = None) -> RenderedReport:
    """Render the comparison in `folder` (or the folder of a comparison.json given).

    Call once its runs have finished, or at any time for a partial report (pending runs
    are shown as pending).

    Args:
        advisor: predicts how each run's strategy scales (the advice section, its plot
            and report.json's `advice`); None: no advice section.

    Raises:
        InputFileError: the folder or its comparison.json is missing or malformed, or the
            run folder of a finished run has no readable summary.json.
        OSError: the folder cannot be written.
    """
    folder = Path(folder)
    if folder.name == COMPARISON_FILE and folder.is_file():
        folder = folder.parent
    comparison = read_comparison(folder)
    thresholds, perplexity_targets = comparison["thresholds"], comparison["perplexity_targets"]
    rows = [run_row(entry, load_run(folder / entry["log_dir"]) if entry["status"] == OK else None,
                    thresholds, perplexity_targets) for entry in comparison["runs"]]
    # A language model has no accuracy to reach: it is timed to perplexities instead.
    target = (PERPLEXITY.with_targets(perplexity_targets) if language_models(rows)
              else ACCURACY.with_targets(thresholds))
    base = add_speedups(rows)
    ranked = rankings(rows, target)
    plots = draw_plots(rows, folder / PLOTS_FOLDER)
    advice = advisor(folder, rows) if advisor is not None else None
    advice_plot = draw_advice(advice, folder / PLOTS_FOLDER, run_colors(rows))
    plots += [advice_plot] if advice_plot is not None else []
    meta = {key: comparison.get(key) for key in ("created", "command", "dataset")}
    report = {
        "version": REPORT_VERSION, **meta,
        "rendered": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "thresholds": list(target.targets) if target.name == ACCURACY.name else [],
        "perplexity_targets": list(target.targets) if target.name == PERPLEXITY.name else [],
        "baseline": base["name"] if base else None,
        "runs": rows, "ranking": ranked,
        "plots": [plot.path.relative_to(folder).as_posix() for plot in plots],
        "advice": advice.to_dict() if advice is not None else None,
    }
    json_path = write_json_atomic(folder / REPORT_JSON, report)
    body = ReportBody(meta, rows, target, plots, ranked)
    markdown_path = write_file_atomic(folder / REPORT_MARKDOWN, markdown_page(body, folder, advice))
    html_path = write_file_atomic(folder / REPORT_HTML, html_page(body, advice_html(advice)))
    return RenderedReport(table=text_table(rows, target), html_path=html_path, json_path=json_path,
                          markdown_path=markdown_path, plots=[plot.path for plot in plots])


def read_comparison(folder: Path) -> dict[str, Any]:
    """comparison.json of `folder`, checked, its thresholds and perplexity targets as floats.

    Raises:
        InputFileError: one line naming the file (or folder) and what is wrong.
    """
    if not folder.is_dir():
        raise InputFileError(f"{folder}: no such folder (expected a comparison folder made by "
                             "disttrain compare)")
    path = folder / COMPARISON_FILE
    if not path.exists():
        raise InputFileError(f"{folder}: has no {COMPARISON_FILE}, so it is not a comparison folder "
                             "(made by disttrain compare)")
    data = read_json_file(path, "comparison file")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise InputFileError(f"{path}: is not a comparison file (expected an object with a \"runs\" list)")
    missing = [key for key in ("thresholds", "perplexity_targets") if key not in data]
    if missing:
        raise InputFileError(f"{path}: has no {' or '.join(missing)} (a comparison an earlier disttrain "
                             "wrote); run disttrain compare again")
    thresholds = data["thresholds"]
    if not isinstance(thresholds, list) or not all(is_number(t) and 0 < t <= 1 for t in thresholds):
        raise InputFileError(f"{path}: thresholds should be a list of accuracies in (0, 1], "
                             f"not {thresholds!r}")
    perplexity_targets = data["perplexity_targets"]
    if not isinstance(perplexity_targets, list) or not all(is_number(t) and t >= 1
                                                           for t in perplexity_targets):
        raise InputFileError(f"{path}: perplexity_targets should be a list of perplexities >= 1 "
                             f"(1 is a perfect model), not {perplexity_targets!r}")
    names = set()
    for i, entry in enumerate(data["runs"]):
        _check_entry(entry, f"{path}: runs[{i}]")
        if entry["name"] in names:
            raise InputFileError(f"{path}: runs[{i}]: the name {entry['name']!r} is used twice")
        names.add(entry["name"])
    return {**data, "thresholds": [float(t) for t in thresholds],
            "perplexity_targets": [float(t) for t in perplexity_targets]}


def _check_entry(entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise InputFileError(f"{where}: should be an object, not {entry!r}")
    if not isinstance(entry.get("name"), str) or not entry["name"]:
        raise InputFileError(f"{where}: has no name")
    if entry.get("status") not in STATUSES:
        raise InputFileError(f"{where} ({entry['name']}): status should be one of {', '.join(STATUSES)}, "
                             f"not {entry.get('status')!r}")
    if entry["status"] == OK and not isinstance(entry.get("log_dir"), str):
        raise InputFileError(f"{where} ({entry['name']}): a finished run needs its log_dir")
    if entry.get("workers") is not None and not (isinstance(entry["workers"], int) and entry["workers"] > 0):
        raise InputFileError(f"{where} ({entry['name']}): workers should be a positive integer, "
                             f"not {entry['workers']!r}")


def markdown_page(body: ReportBody, folder: Path, advice: AdviceSection | None = None) -> str:
    """report.md: the table, the rankings and the plots linked (relative to `folder`)."""
    meta, rows, target, plots, ranked = body.meta, body.rows, body.target, body.plots, body.rankings
    command = " ".join(meta.get("command") or [])
    lines = [f"# disttrain comparison on {meta.get('dataset') or '?'}", "",
             f"created {meta.get('created') or '?'}" + (f": `{command}`" if command else ""), "",
             markdown_table(rows, target), legend(target), "", "## Rankings", ""]
    lines += [f"- {line}" for line in ranking_lines(rows, ranked, target)]
    for plot in plots:
        lines += ["", f"## {plot.title}", "", f"![{plot.title}]({plot.path.relative_to(folder).as_posix()})",
                  "", plot.caption]
    lines += advice_markdown(advice)
    return "\n".join(lines) + "\n"
