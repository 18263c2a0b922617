"""The metrics stream: JSONL (the source of truth) mirrored to TensorBoard.

Each process writes under its own folder of `log_dir` (`baseline/`, `worker0/`, `rank1/`,
...): `metrics.jsonl`, one JSON object per record with `step`, `epoch`, `time` (wall
clock) and scalars named by the vocabulary in `keys`, and TensorBoard event files with
the same scalars.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from disttrain.metrics.keys import check_keys

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


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

            # TensorBoard hides the events from purge_step on: the resume step's own
            # records stay, as they stay in the JSONL.
            purge_step = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(str(self.folder), purge_step=purge_step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _record_step(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def log(self, step: int, epoch: int, scalars: dict[str, float]) -> None:
        """Append one record; non-finite values are written as null in JSON.

        Raises:
            ValueError: a key is not in the metrics vocabulary.
        """
        check_keys(scalars)
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


