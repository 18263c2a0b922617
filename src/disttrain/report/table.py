"""The comparison table as text (for the terminal), Markdown and cells for HTML, with the
number formats every report shares (seconds, bytes, percentages)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disttrain.metrics.time_to_target import TimeToTarget
from disttrain.report.figures import OK, ranking_key

# Legend of the abbreviated headers, printed under the table.
LEGEND = ("total: wall time; "
          "speed-up: samples/s over the baseline's; eff: speed-up per worker; "
          "B/step: bytes on the wire per step per worker (PS: gradients pushed+parameters pulled; DDP: "
          "gradients all-reduced); compr: compression ratio (push/pull with pull compression); "
          "fail: failures recovered from")
# By the figure a table times: its time-to-target headers' prefix, and their legend.
TARGET_HEADER = {"accuracy": "t", "perplexity": "tppl"}
TARGET_LEGEND = {
    "accuracy": "tNN%: training-clock time to NN% test accuracy (- not reached); ",
    "perplexity": "tpplN: training-clock time to test perplexity N or lower (- not reached); ",
}
LANGUAGE_MODEL_LEGEND = "ppl: test perplexity, exp(mean token loss), in place of a classifier's accuracy; "


def legend(target: TimeToTarget) -> str:
    """The legend of a table timing `target` (a language models' table's says what ppl is)."""
    timed = TARGET_LEGEND[target.name] if target.targets else ""
    return (LANGUAGE_MODEL_LEGEND if target.name == "perplexity" else "") + timed + LEGEND


def language_models(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether the finished runs (one at least) all trained a language model: the table then
    shows perplexity in place of accuracy."""
    finished = [row for row in rows if row["status"] == OK]
    return bool(finished) and all(row.get("final_perplexity") is not None for row in finished)


def headers(target: TimeToTarget) -> list[str]:
    """The columns of a table timing `target`: a language model's shows its perplexity and
    the time to each perplexity target, a classifier's its accuracy and the time to each
    accuracy threshold."""
    return ["run", "status", "ppl" if target.name == "perplexity" else "acc",
            *(TARGET_HEADER[target.name] + target.label(t) for t in target.targets),
            "total", "samples/s", "speed-up", "eff", "B/step", "compr", "fail"]


def cells(row: dict[str, Any], target: TimeToTarget) -> list[str]:
    """The cells of one row; a run that did not finish has two: its name and its status
    with the error ("failed: <error>")."""
    if row["status"] != OK:
        return [row["name"], f"{row['status']}: {row['error']}" if row.get("error") else row["status"]]
    times = row.get(target.field) or {}
    quality = (number(row["final_perplexity"], ".3f") if row.get("final_perplexity") is not None
               else percent(row["final_accuracy"]))
    return [row["name"], OK, quality,
            *(seconds(times.get(target.key(t))) for t in target.targets),
            seconds(row["total_time_s"]), number(row["samples_per_s"], ".0f"),
            number(row["speedup"], ".2f", "x"), percent(row["scaling_efficiency"], ".0f"),
            wire_bytes(row), compression(row), str(row["recovery_events"])]


def wire_bytes(row: dict[str, Any]) -> str:
    """Bytes on the wire per step per worker: a PS run's as gradients pushed + parameters
    pulled, so pull compression's saving shows beside the push's."""
    push, pull = row.get("push_bytes_per_step"), row.get("pull_bytes_per_step")
    if push is None or pull is None:
        return human_bytes(row["bytes_per_step"])
    return f"{human_bytes(push)}+{human_bytes(pull)}"


def compression(row: dict[str, Any]) -> str:
    """The compression ratio; push/pull where the run compressed its pulls too."""
    push = number(row["compression_ratio"], ".1f", "x")
    if row.get("compression_pull_ratio") is None:
        return push
    return f"{push}/{number(row['compression_pull_ratio'], '.1f', 'x')}"


def text_table(rows: Sequence[dict[str, Any]], target: TimeToTarget) -> str:
    """The table for a terminal: aligned columns, numbers to the right, a run that did not
    finish on one line with its error; the legend below."""
    head = headers(target)
    body = [cells(row, target) for row in rows]
    full = [line for line in [head, *body] if len(line) == len(head)]
    widths = [max(len(line[i]) for line in full) for i in range(len(head))]
    lines = []
    for line in [head, *body]:
        if len(line) != len(head):
            lines.append(f"{line[0].ljust(widths[0])}  {line[1]}")
            continue
        padded = [cell.ljust(width) if i < 2 else cell.rjust(width)
                  for i, (cell, width) in enumerate(zip(line, widths, strict=True))]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines + ["", *wrap(legend(target), 110)])


def markdown_table(rows: Sequence[dict[str, Any]], target: TimeToTarget) -> str:
    """The table in Markdown; a run that did not finish has its status and error in the
    status column and dashes elsewhere."""
    head = headers(target)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for row in rows:
        line = cells(row, target)
        line += ["-"] * (len(head) - len(line))
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |")
    return "\n".join(lines) + "\n"


def ranking_lines(rows: Sequence[dict[str, Any]], rankings: dict[str, Any],
                  target: TimeToTarget) -> list[str]:
    """The rankings in words: "time to 90%: ddp 0.41s, ps-sync 0.52s; not reached: ...", or
    a language model's "time to perplexity 16: ..."."""
    by_name = {row["name"]: row for row in rows}
    lines = []
    for t in target.targets:
        key = target.key(t)
        names = rankings[ranking_key(target)].get(key, [])
        times = [(name, by_name[name][target.field].get(key)) for name in names]
        reached = ", ".join(f"{name} {seconds(time)}" for name, time in times if time is not None)
        missed = ", ".join(name for name, time in times if time is None)
        goal = target.label(t) if target.percent else f"{target.name} {target.label(t)}"
        lines.append(f"time to {goal}: {reached or 'none reached it'}"
                     + (f"; not reached: {missed}" if missed and reached else ""))
    lines.append("samples/s: " + (", ".join(
        f"{name} {number(by_name[name]['samples_per_s'], '.0f')}" for name in rankings["samples_per_s"])
        or "-"))
    return lines


def wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def seconds(value: float | None) -> str:
    """12.3s, 2m05s; "-" for None."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.2f}s"
    if value < 60:
        return f"{value:.1f}s"
    minutes, rest = divmod(round(value), 60)
    return f"{minutes}m{rest:02d}s"


def human_bytes(value: float | None) -> str:
    """Bytes in decimal units: 0, 512 B, 212.0 KB, 1.7 MB; "-" for None."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def percent(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value * 100:{spec}}%"


def number(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"
