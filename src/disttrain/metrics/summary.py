"""The run summary: what a run ends with, the same fields for every strategy, written
as `<log_dir>/summary.json` by the one process that evaluates the final model."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.json"


@dataclass
class RunSummary:
    """The fields of `keys.SUMMARY`, plus strategy-specific figures in `extra` (written at
    the top level of summary.json beside the others)."""

    strategy: str
    dataset: str
    final_accuracy: float
    final_loss: float
    total_time_s: float
    train_time_s: float
    throughput_samples_per_s: float
    samples_processed: int
    steps: int
    epochs: int
    world_size: int
    config: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, *, strategy: str, config: Any, final_accuracy: float, final_loss: float,
               total_time_s: float, train_time_s: float, samples_processed: int, steps: int,
               world_size: int, extra: dict[str, Any] | None = None) -> RunSummary:
        """The summary of a finished run; the throughput is samples over the training clock.

        Args:
            config: the run's `Config`.
            train_time_s: the longest training clock of the run's processes.
        """
        return cls(strategy=strategy, dataset=config.training.dataset, final_accuracy=final_accuracy,
                   final_loss=final_loss, total_time_s=total_time_s, train_time_s=train_time_s,
                   throughput_samples_per_s=samples_processed / max(train_time_s, 1e-9),
                   samples_processed=int(samples_processed), steps=int(steps),
                   epochs=config.training.num_epochs, world_size=world_size,
                   config=config.to_dict(), extra=dict(extra or {}))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out

    def lines(self) -> list[str]:
        """The summary as the command prints it."""
        return [
            f"Strategy: {self.strategy} (world size {self.world_size}, dataset {self.dataset})",
            f"Final Accuracy: {self.final_accuracy * 100:.2f}%",
            f"Final Loss: {self.final_loss:.4f}",
            f"Total Time: {self.total_time_s:.2f}s",
            f"Throughput: {self.throughput_samples_per_s:.1f} samples/s",
        ] + ([f"Gradient Compression: {self.extra['compression_ratio']:.1f}x fewer bytes "
              f"({self.extra['compression_bytes_sent'] / 1e6:.1f} MB sent)"]
             if "compression_ratio" in self.extra else []) + self._recovery_lines()

    def _recovery_lines(self) -> list[str]:
        """What the run's failures cost (parameter server runs)."""
        extra = self.extra
        if "samples_lost" not in extra:
            return []
        lines = [f"Data: {extra['samples_applied']} samples applied, {extra['samples_redone']} redone, "
                 f"{extra['samples_lost']} lost"]
        for failure in extra.get("failures", []):
            figures = ", ".join(f"{name} {failure[key]:.2f}s" for name, key in (
                ("detected in", "detect_s"), ("back at work in", "recover_s")) if key in failure)
            lines.append(f"Failure: {failure['process']} {failure['reason']}"
                         + (f" ({figures})" if figures else ""))
        if extra.get("stragglers"):
            lines.append(f"Stragglers: {', '.join(extra['stragglers'])}")
        return lines

    def write(self, path: str | Path) -> Path:
        """Write the summary as JSON at `path` atomically (a folder gets `summary.json`)."""
        path = Path(path)
        if path.is_dir():
            path = path / SUMMARY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> RunSummary:
        """Read a summary.json (or the one in folder `path`).

        Raises:
            OSError: the file cannot be read. ValueError: it is not a summary.
        """
        path = Path(path)
        if path.is_dir():
            path = path / SUMMARY_FILE
        data = json.loads(path.read_text(encoding="utf-8"))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        if not isinstance(data, dict) or not names <= set(data):
            raise ValueError(f"{path} is not a run summary")
        return cls(**{k: data.pop(k) for k in names}, extra=data)
