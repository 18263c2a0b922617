"""A finished run as a report reads it: its summary.json and every process's
metrics.jsonl, with the series the figures and plots are made from.

A run folder (`<log_dir>`) holds `summary.json` and one folder per process (`baseline`,
`worker<N>`, `rank<R>`) with `metrics.jsonl`. Window records carry `loss/train`; epoch-end
records carry `accuracy/test` (a language model's: `perplexity/test`). Every time here is
on the training clock of the process that evaluates for the run (`baseline`, `worker0` or
`rank0`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.core.errors import InputFileError
from disttrain.metrics.logger import METRICS_FILE, read_metrics
from disttrain.metrics.summary import SUMMARY_FILE
from disttrain.report.files import read_json_file

# The process that evaluates for the run, in the order they are looked for.
EVALUATING_PROCESSES = ("baseline", "worker0", "rank0")
# The summary fields a report needs (those every summary has had); others are optional.
SUMMARY_NUMBERS = ("final_accuracy", "final_loss", "total_time_s", "train_time_s",
                   "throughput_samples_per_s", "samples_processed", "steps", "world_size")

Record = dict[str, Any]


TEST_FIGURES = ("accuracy/test", "perplexity/test")  # what marks an evaluation record


@dataclass(frozen=True)
class Evaluation:
    """One epoch-end evaluation: where it happened on the training clock and its result
    (a classifier's accuracy, or a language model's perplexity)."""

    step: int
    epoch: int
    train_time_s: float | None
    accuracy: float | None
    loss: float | None
    perplexity: float | None = None

    def figure(self, metric: str) -> float | None:
        """The figure of metric key `metric` (`accuracy/test` or `perplexity/test`)."""
        return {"accuracy/test": self.accuracy, "perplexity/test": self.perplexity}[metric]


@dataclass(frozen=True)
class TrainWindow:
    """One logged window of training steps."""

    step: int
    train_time_s: float | None
    loss: float | None
    accuracy: float | None
    perplexity: float | None = None


@dataclass
class RunData:
    """A run folder read into memory.

    Attributes:
        processes: process name (`worker0`, ...) -> its records in the order written; the
            processes ordered by the number in their names.
    """

    log_dir: Path
    summary: dict[str, Any]
    processes: dict[str, list[Record]] = field(default_factory=dict)

    @property
    def evaluating_process(self) -> str | None:
        """The process whose records hold the run's evaluations (None without records)."""
        for name in EVALUATING_PROCESSES:
            if name in self.processes:
                return name
        evaluating = [name for name, records in self.processes.items()
                      if any(key in record for record in records for key in TEST_FIGURES)]
        return evaluating[0] if evaluating else None

    def evaluations(self) -> list[Evaluation]:
        name = self.evaluating_process
        return evaluations(self.processes[name]) if name else []

    def train_windows(self) -> list[TrainWindow]:
        name = self.evaluating_process
        return train_windows(self.processes[name]) if name else []


def load_run(log_dir: str | Path) -> RunData:
    """Read the run in `log_dir`: summary.json and `<process>/metrics.jsonl` of each process.

    Raises:
        InputFileError: summary.json is missing, not JSON or not a run summary, or a
            metrics file cannot be read. A run without metrics files is read (no series).
    """
    log_dir = Path(log_dir)
    path = log_dir / SUMMARY_FILE
    summary = read_json_file(path, "run summary")
    check_summary(summary, path)
    return RunData(log_dir=log_dir, summary=summary, processes=read_processes(log_dir))


def read_processes(log_dir: Path, prefix: str = "") -> dict[str, list[Record]]:
    """The records of every process folder in `log_dir` whose name starts with `prefix`,
    ordered by the number in the name.

    Raises:
        InputFileError: a metrics file cannot be read.
    """
    processes: dict[str, list[Record]] = {}
    found = sorted(log_dir.glob(f"{prefix}*/{METRICS_FILE}"), key=lambda p: natural_key(p.parent.name))
    for metrics in found:
        try:
            processes[metrics.parent.name] = read_metrics(metrics)
        except (OSError, UnicodeDecodeError) as e:
            raise InputFileError(f"{metrics}: cannot be read ({e})") from e
    return processes


def check_summary(summary: Any, path: Path) -> None:
    """Raises InputFileError unless `summary` has every field of a run summary, with a
    number where a number belongs."""
    if not isinstance(summary, dict):
        raise InputFileError(f"{path}: is not a run summary (expected a JSON object)")
    missing = [name for name in ("strategy", *SUMMARY_NUMBERS) if name not in summary]
    if missing:
        raise InputFileError(f"{path}: is not a run summary (missing {', '.join(missing)})")
    for name in SUMMARY_NUMBERS:
        if not is_number(summary[name]):
            raise InputFileError(f"{path}: {name} should be a number, not {summary[name]!r}")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
    """`value` as a float; None when it is absent or not a finite number."""
    if not is_number(value) or not math.isfinite(value):
        return None
    return float(value)


def natural_key(name: str) -> tuple:
    """`worker2` before `worker10`."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def process_index(name: str) -> int | None:
    """The number a process name ends with: `rank1` -> 1; None when it has none."""
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else None


def windows(records: list[Record]) -> list[Record]:
    """The window records (of training steps, not of evaluations)."""
    return [record for record in records if "loss/train" in record or "time/step_s" in record]


def evaluations(records: list[Record]) -> list[Evaluation]:
    """The epoch-end evaluations of one process, each placed on its training clock: the
    record's own `progress/train_time_s` when it has one, else interpolated by step between
    the windows around it (the clock does not run during an evaluation)."""
    clock = _clock_points(records)
    found = []
    for record in records:
        accuracy, perplexity = (finite(record.get(key)) for key in TEST_FIGURES)
        if accuracy is None and perplexity is None:
            continue
        step = int(record["step"])
        own_clock = finite(record.get("progress/train_time_s"))
        found.append(Evaluation(step=step, epoch=int(record.get("epoch", 0)),
                                train_time_s=own_clock if own_clock is not None else _clock_at(clock, step),
                                accuracy=accuracy, loss=finite(record.get("loss/test")),
                                perplexity=perplexity))
    return found


def train_windows(records: list[Record]) -> list[TrainWindow]:
    """The training windows of one process, with their place on its training clock."""
    return [TrainWindow(step=int(record["step"]), train_time_s=finite(record.get("progress/train_time_s")),
                        loss=finite(record.get("loss/train")), accuracy=finite(record.get("accuracy/train")),
                        perplexity=finite(record.get("perplexity/train")))
            for record in windows(records)]


def _clock_points(records: list[Record]) -> list[tuple[int, float]]:
    points = {0: 0.0}
    for record in windows(records):
        clock = finite(record.get("progress/train_time_s"))
        if clock is not None:
            points[int(record["step"])] = clock
    return sorted(points.items())


def _clock_at(points: list[tuple[int, float]], step: int) -> float | None:
    """The training clock at `step`: linear between the points around it, and past the
    last one at the pace of the last two; None with nothing to go by."""
    if len(points) < 2:
        return None
    for (step0, time0), (step1, time1) in zip(points, points[1:], strict=False):
        if step0 <= step <= step1:
            return time0 + (time1 - time0) * (step - step0) / max(step1 - step0, 1)
    (step0, time0), (step1, time1) = points[-2], points[-1]
    return time1 + (time1 - time0) / max(step1 - step0, 1) * (step - step1)
