"""The comparison's plots as PNG files, drawn from report rows (the runs of report.json).

Matplotlib's object API with the Agg canvas: no pyplot, so no global figure state and no
display needed; matplotlib is loaded on the first plot. Each run keeps one colour in
every plot; runs that did not finish are not drawn. A plot with nothing to show (no PS
run for the staleness histogram) is not written.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.report.figures import OK
from disttrain.report.files import write_file_atomic
from disttrain.report.table import human_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Row = dict[str, Any]
SIZE_IN = (8.0, 4.5)
DPI = 100
LOG_SCALE_SPREAD = 100  # bytes bars go log-scale when the largest is this many times the smallest


@dataclass(frozen=True)
class Plot:
    """A written plot: its file, title and what it shows."""

    path: Path
    title: str
    caption: str


def draw_plots(rows: Sequence[Row], folder: Path) -> list[Plot]:
    """Draw every plot of the finished runs in `rows` into `folder` (created); plots of a
    previous rendering that have nothing to show now are removed.

    Returns:
        The plots written, in the order of `PLOTS`.
    """
    folder.mkdir(parents=True, exist_ok=True)
    finished = [row for row in rows if row["status"] == OK]
    colors = run_colors(rows)
    written = []
    for file_name, title, caption, draw in PLOTS:
        path = folder / file_name
        path.unlink(missing_ok=True)
        figure = draw(finished, colors)
        if figure is None:
            continue
        figure.suptitle(title)
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=DPI)
        write_file_atomic(path, png.getvalue())
        written.append(Plot(path, title, caption))
    return written


def run_colors(rows: Sequence[Row]) -> dict[str, str]:
    """Each run's colour, the same in every plot."""
    return {row["name"]: f"C{i % 10}" for i, row in enumerate(rows)}


def _figure() -> tuple[Figure, Any]:
    # Imported here: matplotlib takes most of a second to load, and every CLI command
    # imports this package.
    from matplotlib.figure import Figure

    figure = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    return figure, figure.subplots()


def _figure_vs_time(rows: Sequence[Row], colors: dict[str, str], name: str) -> tuple[Figure, Any, bool]:
    """Each run's test `name` (accuracy, perplexity) at its evaluations against the
    training clock, and faint, its training windows' figure; whether any line was drawn."""
    figure, axes = _figure()
    drawn = False
    for row in rows:
        test = [(p["train_time_s"], p[name]) for p in row["series"]["test"]
                if p["train_time_s"] is not None and p.get(name) is not None]
        train = [(w["train_time_s"], w[name]) for w in row["series"]["train"]
                 if w["train_time_s"] is not None and w.get(name) is not None]
        if train:  # faint, so a run with one evaluation still shows a curve
            axes.plot(*zip(*train, strict=True), color=colors[row["name"]], alpha=0.3, linewidth=1,
                      label=None if test else f"{row['name']} (train)")
        if test:
            axes.plot(*zip(*test, strict=True), color=colors[row["name"]], marker="o", label=row["name"])
        drawn = drawn or bool(test or train)
    return figure, axes, drawn


def accuracy_vs_time(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    figure, axes, drawn = _figure_vs_time(rows, colors, "accuracy")
    return _line_plot(figure, axes, drawn, "training time (s, training clock of the evaluating process)",
                      "accuracy (solid: test; faint: train windows)")


def perplexity_vs_time(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    figure, axes, drawn = _figure_vs_time(rows, colors, "perplexity")
    from matplotlib.ticker import LogFormatter

    axes.set_yscale("log")  # from 256 (a uniform guess over bytes) down to a few
    for axis_formatter in (axes.yaxis.set_major_formatter, axes.yaxis.set_minor_formatter):
        axis_formatter(LogFormatter(labelOnlyBase=False))  # 20, 40: not 2x10^1
    return _line_plot(figure, axes, drawn, "training time (s, training clock of the evaluating process)",
                      "perplexity, log scale (solid: test; faint: train windows)")


def loss_vs_step(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    """Each run's training loss per logged window; a run of fewer than `FEW_WINDOWS`
    windows is drawn as points, and one of a single window says why it is no curve (a line
    through one point draws nothing)."""
    figure, axes = _figure()
    drawn, single = False, []
    for row in rows:
        points = [(w["step"], w["loss"]) for w in row["series"]["train"] if w["loss"] is not None]
        if points:
            axes.plot(*zip(*points, strict=True), color=colors[row["name"]], label=row["name"],
                      marker="o" if len(points) < FEW_WINDOWS else None)
            drawn = True
            single += [row["name"]] if len(points) == 1 else []
    if single:
        axes.text(0.5, 0.02, f"one logged window for {', '.join(single)}: the run was shorter than two "
                  "windows of training.log_interval steps (--set training.log_interval=N)",
                  transform=axes.transAxes,
                  ha="center", va="bottom", fontsize="small", wrap=True)
    return _line_plot(figure, axes, drawn, "step", "training loss (nats, window mean)")


FEW_WINDOWS = 20  # fewer logged windows than this: each drawn as a point too


def _line_plot(figure: Figure, axes, drawn: bool, xlabel: str, ylabel: str) -> Figure | None:
    """Label a plot of lines, or None when no line was drawn."""
    if not drawn:
        return None
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def _bars(rows: Sequence[Row], colors: dict[str, str], values: list[float], labels: list[str],
          ylabel: str) -> Figure:
    figure, axes = _figure()
    names = [row["name"] for row in rows]
    bars = axes.bar(names, values, color=[colors[name] for name in names])
    axes.bar_label(bars, labels=labels, fontsize="small")
    axes.set_ylabel(ylabel)
    axes.tick_params(axis="x", labelrotation=20)
    axes.grid(axis="y", alpha=0.3)
    return figure


def _value_bars(rows: Sequence[Row], colors: dict[str, str], key: str, label, ylabel: str) -> Figure | None:
    """One bar per run that has `key`, labelled with `label(value)`; None when no run has it."""
    rows = [row for row in rows if row[key] is not None]
    if not rows:
        return None
    values = [row[key] for row in rows]
    return _bars(rows, colors, values, [label(value) for value in values], ylabel)


def throughput(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    return _value_bars(rows, colors, "samples_per_s", lambda value: f"{value:.0f}",
                       "samples/s (training clock)")


def step_time_split(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    rows = [row for row in rows if row["step_time"]["step_s"] is not None]
    if not rows:
        return None
    figure, axes = _figure()
    names = [row["name"] for row in rows]
    ms = [{key: (row["step_time"][key] or 0.0) * 1e3
           for key in ("compute_s", "comm_blocked_s", "compression_s")} for row in rows]
    compute = [max(split["compute_s"] - split["compression_s"], 0.0) for split in ms]
    communication = [split["comm_blocked_s"] for split in ms]
    compression = [split["compression_s"] for split in ms]
    axes.bar(names, compute, label="compute", color="C0")
    axes.bar(names, communication, bottom=compute, label="communication (blocked)", color="C1")
    axes.bar(names, compression, bottom=[a + b for a, b in zip(compute, communication, strict=True)],
             label="compression", color="C2")
    axes.set_ylabel("time per step (ms, mean over processes)")
    axes.tick_params(axis="x", labelrotation=20)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def bytes_per_step(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    figure = _value_bars(rows, colors, "bytes_per_step", human_bytes, "bytes on the wire per step per worker")
    if figure is None:
        return None
    values = [row["bytes_per_step"] for row in rows if row["bytes_per_step"] is not None]
    from matplotlib.ticker import EngFormatter

    figure.axes[0].yaxis.set_major_formatter(EngFormatter(unit="B"))
    positive = [value for value in values if value > 0]
    if positive and max(positive) > LOG_SCALE_SPREAD * min(positive):
        figure.axes[0].set_yscale("log")
    return figure


def staleness(rows: Sequence[Row], colors: dict[str, str]) -> Figure | None:
    rows = [row for row in rows if row["staleness_histogram"]]
    if not rows:
        return None
    figure, axes = _figure()
    levels = sorted({int(key) for row in rows for key in row["staleness_histogram"]})
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        histogram = row["staleness_histogram"]
        total = sum(histogram.values()) or 1
        shares = [histogram.get(str(level), 0) / total for level in levels]
        axes.bar([level - 0.4 + width * (i + 0.5) for level in levels], shares, width=width,
                 color=colors[row["name"]], label=row["name"])
    axes.set_xticks(levels)
    axes.set_xlabel("staleness (server updates since the pushed gradient's parameters)")
    axes.set_ylabel("share of pushes")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize="small")
    return figure


# file name, title, caption, drawing function
PLOTS: list[tuple[str, str, str, Callable[[Sequence[Row], dict[str, str]], Figure | None]]] = [
    ("accuracy_vs_time.png", "Test accuracy against training time",
     "Test accuracy at each evaluation (markers) against the training clock; the faint lines "
     "are the training accuracy of each logged window.", accuracy_vs_time),
    ("perplexity_vs_time.png", "Test perplexity against training time",
     "A language model's test perplexity at each evaluation (markers) against the training "
     "clock; the faint lines are the training perplexity of each logged window.", perplexity_vs_time),
    ("loss_vs_step.png", "Training loss against step",
     "Mean training loss of each logged window of the evaluating process.", loss_vs_step),
    ("throughput.png", "Samples per second",
     "Samples all processes trained on over the run's training clock.", throughput),
    ("step_time.png", "Time per step",
     "Mean time per step over the processes: compute (less compression), communication a "
     "step waited on, and compression.", step_time_split),
    ("bytes_per_step.png", "Bytes on the wire per step",
     "Bytes a worker or rank moved per step (PS: gradients sent + parameters received; DDP: "
     "gradients all-reduced, or sent compressed).", bytes_per_step),
    ("staleness.png", "Staleness of the parameter server's pushes",
     "Share of pushes by staleness, for the parameter-server runs.", staleness),
]
