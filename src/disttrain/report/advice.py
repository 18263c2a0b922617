"""The advice section of a comparison's report: how each strategy the comparison ran would
scale, as `disttrain advise`'s cost model predicts it from the comparison's own
measurements, with the samples/s each run measured drawn beside the prediction at its
number of workers.

The report draws and writes what it is given and predicts nothing itself: the
prediction lives above it (`disttrain.advise.comparison`), and the command that renders
passes it in as an `Advisor`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from disttrain.report.files import write_file_atomic
from disttrain.report.plots import DPI, Plot

ADVICE_PLOT = "advice_scaling.png"
TITLE = "Predicted scaling against what was measured"
CAPTION = ("Left: speed-up over one process alone that the cost model of `disttrain advise` predicts "
           "for each run's configuration at 1 to {max_workers} workers (lines), from the step time and "
           "compressor costs this comparison measured and the link named below; markers: the speed-up "
           "each run measured over the baseline at its own number of workers. Right: predicted and "
           "measured samples/s at those numbers of workers.")
_SIZE_IN = (11.0, 4.5)


@dataclass(frozen=True)
class ScalingCurve:
    """One run's predicted scaling and, when it finished, what it measured.

    Args:
        run: the run's name in the comparison.
        configuration: what was predicted, as `disttrain advise` names it.
        worker_counts: ascending; the run's own count among them.
        samples_per_s, speedup: the prediction at each count (speed-up over one process
            alone, as the cost model has it).
    """

    run: str
    configuration: str
    worker_counts: tuple[int, ...]
    samples_per_s: tuple[float, ...]
    speedup: tuple[float, ...]
    measured_workers: int | None = None
    measured_samples_per_s: float | None = None
    measured_speedup: float | None = None

    def predicted_at(self, num_workers: int) -> tuple[float, float] | None:
        """(samples/s, speed-up) predicted at `num_workers`, None if not predicted there."""
        if num_workers not in self.worker_counts:
            return None
        i = self.worker_counts.index(num_workers)
        return self.samples_per_s[i], self.speedup[i]

    def measured(self) -> dict[str, Any] | None:
        if self.measured_workers is None or self.measured_samples_per_s is None:
            return None
        predicted = self.predicted_at(self.measured_workers)
        samples, speedup = predicted if predicted else (None, None)
        return {"num_workers": self.measured_workers, "samples_per_s": self.measured_samples_per_s,
                "speedup": self.measured_speedup, "predicted_samples_per_s": samples,
                "predicted_speedup": speedup,
                "predicted_over_measured": samples / self.measured_samples_per_s
                if samples is not None and self.measured_samples_per_s > 0 else None}

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "configuration": self.configuration,
                "predicted": [{"num_workers": n, "samples_per_s": s, "speedup": u}
                              for n, s, u in zip(self.worker_counts, self.samples_per_s, self.speedup,
                                                 strict=True)],
                "measured": self.measured()}


@dataclass(frozen=True)
class AdviceSection:
    """What the advice section shows.

    Args:
        curves: one per finished run predicted, in the comparison's order.
        inputs: what the predictions used (workload, link, compressors) and where each
            number came from.
        skipped: runs not predicted -> why.
        unavailable: why there is no prediction at all (empty when there is one).
    """

    curves: tuple[ScalingCurve, ...] = ()
    inputs: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    unavailable: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "curves": [c.to_dict() for c in self.curves],
                "skipped": self.skipped, "unavailable": self.unavailable or None,
                "plot": f"plots/{ADVICE_PLOT}" if self.curves else None}

    def lines(self) -> list[str]:
        """The section's text: what was predicted from what, and predicted against measured."""
        if not self.curves:
            return [f"No prediction: {self.unavailable or 'no run to predict'}."]
        lines = [self.inputs.get("description", "")] if self.inputs.get("description") else []
        for curve in self.curves:
            measured = curve.measured()
            if measured is None or measured["predicted_samples_per_s"] is None:
                continue
            lines.append(f"{curve.run} ({curve.configuration}) at {measured['num_workers']} workers: "
                         f"predicted {measured['predicted_samples_per_s']:.4g} samples/s, measured "
                         f"{measured['samples_per_s']:.4g} (predicted/measured "
                         f"{measured['predicted_over_measured']:.2f})")
        lines += [f"{run}: not predicted ({why})" for run, why in self.skipped.items()]
        return lines


# The rendering command's prediction: (comparison folder, report rows) -> the section.
Advisor = Callable[[Path, Sequence[dict[str, Any]]], AdviceSection]


def draw_advice(section: AdviceSection | None, folder: Path, colors: dict[str, str]) -> Plot | None:
    """Draw the section's plot into `folder` (a previous one removed when there is none).

    Args:
        colors: run name -> its colour in the report's other plots.
    """
    path = folder / ADVICE_PLOT
    path.unlink(missing_ok=True)
    if section is None or not section.curves:
        return None
    from matplotlib.figure import Figure  # loaded on first use, as the other plots

    figure = Figure(figsize=_SIZE_IN, dpi=DPI, layout="constrained")
    scaling, bars = figure.subplots(1, 2, width_ratios=(3, 2))
    for curve in section.curves:
        color = colors.get(curve.run, "C0")
        scaling.plot(curve.worker_counts, curve.speedup, color=color,
                     label=f"{curve.run}: {curve.configuration}")
        if curve.measured_workers is not None and curve.measured_speedup is not None:
            scaling.plot([curve.measured_workers], [curve.measured_speedup], "o", color=color, markersize=8,
                         markeredgecolor="black")
    top = max(n for c in section.curves for n in c.worker_counts)
    scaling.plot([1, top], [1, top], ":", color="grey", label="linear")
    from matplotlib.ticker import ScalarFormatter

    scaling.set_xscale("log", base=2)
    scaling.set_yscale("log", base=2)
    scaling.xaxis.set_major_formatter(ScalarFormatter())
    scaling.yaxis.set_major_formatter(ScalarFormatter())
    scaling.set_xlabel("workers")
    scaling.set_ylabel("speed-up over one process")
    scaling.grid(alpha=0.3)
    scaling.legend(fontsize="x-small")
    measured = [(c, c.measured()) for c in section.curves]
    measured = [(c, m) for c, m in measured if m is not None and m["predicted_samples_per_s"] is not None]
    for i, (curve, m) in enumerate(measured):
        color = colors.get(curve.run, "C0")
        bars.bar(i - 0.2, m["predicted_samples_per_s"], width=0.4, color=color, alpha=0.45,
                 label="predicted" if i == 0 else None)
        bars.bar(i + 0.2, m["samples_per_s"], width=0.4, color=color, edgecolor="black",
                 label="measured" if i == 0 else None)
    bars.set_xticks(range(len(measured)), [f"{c.run}\n(n={m['num_workers']})" for c, m in measured],
                    fontsize="x-small")
    bars.set_ylabel("samples/s")
    bars.grid(axis="y", alpha=0.3)
    if measured:
        bars.legend(fontsize="small")
    figure.suptitle(TITLE)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=DPI)
    write_file_atomic(path, png.getvalue())
    return Plot(path, TITLE, CAPTION.format(max_workers=top))


def advice_markdown(section: AdviceSection | None) -> list[str]:
    """The section's lines of report.md (the plot is linked with the others)."""
    if section is None:
        return []
    return ["", "## Predicted scaling (disttrain advise)", "", *[f"- {line}" for line in section.lines()]]


def advice_html(section: AdviceSection | None) -> str:
    if section is None:
        return ""
    items = "\n".join(f"<li>{escape(line)}</li>" for line in section.lines())
    return f"<h2>Predicted scaling (disttrain advise)</h2>\n<ul>\n{items}\n</ul>"
