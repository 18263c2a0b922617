"""The comparison as one self-contained HTML page: the table and every plot inline
(`data:image/png;base64`), inline CSS, no script and nothing fetched from the network,
so the file can be mailed, archived or opened offline as it is."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from disttrain.metrics.time_to_target import TimeToTarget
from disttrain.report.plots import Plot
from disttrain.report.table import cells, headers, legend, ranking_lines

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.3em 0.6em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th:nth-child(-n+2), td:nth-child(-n+2) { text-align: left; }
tr.failed td, tr.pending td { color: #a00; text-align: left; white-space: normal; }
p.meta, p.legend, figcaption { color: #555; font-size: 0.85em; }
code { font-size: 0.9em; }
figure { margin: 1.5em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
"""


@dataclass(frozen=True)
class ReportBody:
    """What every page of a report shows.

    Attributes:
        meta: dataset, created, command (a list) of the comparison.
        rows, rankings: as in report.json.
        target: the figure the table times, with its targets.
        plots: the PNG files drawn.
    """

    meta: dict[str, Any]
    rows: Sequence[dict[str, Any]]
    target: TimeToTarget
    plots: Sequence[Plot]
    rankings: dict[str, Any]


def html_page(body: ReportBody, extra: str = "") -> str:
    """The page of `body`, its plots inlined; `extra`: HTML of further sections, after the
    plots (the advice section).

    Raises:
        OSError: a plot file cannot be read.
    """
    meta, rows, target, plots, rankings = body.meta, body.rows, body.target, body.plots, body.rankings
    command = " ".join(meta.get("command") or [])
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>disttrain comparison: {escape(str(meta.get('dataset', '')))}</title>",
        f"<style>{STYLE}</style>", "</head>", "<body>",
        f"<h1>disttrain comparison on {escape(str(meta.get('dataset', '?')))}</h1>",
        f"<p class=\"meta\">created {escape(str(meta.get('created', '?')))}"
        + (f"<br><code>{escape(command)}</code>" if command else "") + "</p>",
        _table(rows, target),
        f'<p class="legend">{escape(legend(target))}</p>',
        _rankings(rows, rankings, target),
    ]
    for plot in plots:
        data = base64.b64encode(plot.path.read_bytes()).decode("ascii")
        parts += [f"<h2>{escape(plot.title)}</h2>", "<figure>",
                  f'<img src="data:image/png;base64,{data}" alt="{escape(plot.title)}">',
                  f"<figcaption>{escape(plot.caption)}</figcaption>", "</figure>"]
    parts += [extra] if extra else []
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def _table(rows: Sequence[dict[str, Any]], target: TimeToTarget) -> str:
    head = headers(target)
    lines = ["<table>", "<tr>" + "".join(f"<th>{escape(cell)}</th>" for cell in head) + "</tr>"]
    for row in rows:
        line = cells(row, target)
        if len(line) < len(head):
            lines.append(f'<tr class="{escape(row["status"])}"><td>{escape(line[0])}</td>'
                         f'<td colspan="{len(head) - 1}">{escape(line[1])}</td></tr>')
        else:
            lines.append("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in line) + "</tr>")
    return "\n".join(lines + ["</table>"])


def _rankings(rows: Sequence[dict[str, Any]], rankings: dict[str, Any], target: TimeToTarget) -> str:
    items = [f"<li>{escape(line)}</li>" for line in ranking_lines(rows, rankings, target)]
    return "<h2>Rankings</h2>\n<ul>\n" + "\n".join(items) + "\n</ul>"
