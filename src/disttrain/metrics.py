"""Metrics: a JSONL stream (the source of truth) mirrored to TensorBoard, step timers, a
progress display, and the run summary.

Each process writes under its own folder of `log_dir` (`baseline/`, `worker0/`, `rank1/`,
...): `metrics.jsonl`, one JSON object per logged step with `step`, `epoch`, `time` (wall
clock) and namespaced scalars (`loss/train`, `accuracy/test`, `throughput/samples_per_s`,
`time/compute_s`, ...), and TensorBoard event files with the same scalars.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


class MetricsLogger:
    """Writes scalars to `<folder>/metrics.jsonl` and to TensorBoard event files there.

    Args:
        folder: this process's metrics folder (created).
        resume_step: when resuming from a checkpoint of this step, records of later steps
            (work that is about to be redone) are dropped from the JSONL and TensorBoard.
        tensorboard: also write TensorBoard events.
    """

    def __init__(self, folder: str | Path, resume_step: int | None = None, tensorboard: bool = True):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / METRICS_FILE
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.folder), purge_step=resume_step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _record_step(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def log(self, step: int, epoch: int, scalars: dict[str, float]) -> None:
        """Append one record; non-finite values are written as null in JSON."""
        record = {"step": step, "epoch": epoch, "time": time.time()}
        record.update({k: (float(v) if math.isfinite(v) else None) for k, v in scalars.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return sys.maxsize  # a torn last line from a killed process is dropped


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a `metrics.jsonl` file (a torn last line is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


class StepTimer:
    """Accumulates wall time per named phase; `drain()` returns `time/<phase>_s` and resets."""

    def __init__(self):
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] += time.perf_counter() - start

    def drain(self) -> dict[str, float]:
        out = {f"time/{name}_s": total for name, total in self._totals.items()}
        self._totals.clear()
        return out


@dataclass
class TrainWindow:
    """Sums over the training steps between two metric records (every strategy keeps one
    and starts a fresh one after each record)."""

    started: float = field(default_factory=time.perf_counter)
    loss_sum: float = 0.0
    num_correct: int = 0
    num_samples: int = 0
    num_steps: int = 0

    def add(self, loss: float, num_correct: int, num_samples: int) -> None:
        """Count one step whose mean loss over `num_samples` samples was `loss`."""
        self.loss_sum += loss * num_samples
        self.num_correct += num_correct
        self.num_samples += num_samples
        self.num_steps += 1

    def scalars(self, now: float | None = None) -> dict[str, float]:
        """`loss/train`, `accuracy/train` and `throughput/samples_per_s` of the window."""
        now = time.perf_counter() if now is None else now
        samples = max(self.num_samples, 1)
        return {"loss/train": self.loss_sum / samples,
                "accuracy/train": self.num_correct / samples,
                "throughput/samples_per_s": self.num_samples / max(now - self.started, 1e-9)}


class Progress:
    """A tqdm bar on an interactive terminal; otherwise a plain log line every ~10%."""

    def __init__(self, total: int, description: str, initial: int = 0, enabled: bool = True):
        self.total = max(total, 1)
        self.count = initial
        self.description = description
        self._bar = None
        self._next_line = initial + max(self.total // 10, 1)
        self._enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=description, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: float) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        elif self._enabled and self.count >= self._next_line:
            self._next_line += max(self.total // 10, 1)
            extras = " ".join(f"{k}={v:.4g}" for k, v in postfix.items())
            logger.info("%s %d/%d %s", self.description, self.count, self.total, extras)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class RunSummary:
    """What a run ends with, the same for every strategy; written as `summary.json`."""

    strategy: str
    dataset: str
    final_accuracy: float
    final_loss: float
    total_time_s: float
    throughput_samples_per_s: float
    samples_processed: int
    steps: int
    epochs: int
    world_size: int
    config: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out

    def lines(self) -> list[str]:
        """The seed's summary lines."""
        return [
            f"Strategy: {self.strategy} (world size {self.world_size}, dataset {self.dataset})",
            f"Final Accuracy: {self.final_accuracy * 100:.2f}%",
            f"Final Loss: {self.final_loss:.4f}",
            f"Total Time: {self.total_time_s:.2f}s",
            f"Throughput: {self.throughput_samples_per_s:.1f} samples/s",
        ]

    def write(self, log_dir: str | Path, extra_path: str | Path | None = None) -> list[Path]:
        """Write `summary.json` into `log_dir` and, when given, at `extra_path` too."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"
        targets = [Path(log_dir) / SUMMARY_FILE] + ([Path(extra_path)] if extra_path else [])
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        return targets
