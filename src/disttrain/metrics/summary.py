"""The run summary: what a run ends with, the same fields for every strategy, written
as `<log_dir>/summary.json` by the one process that evaluates the final model."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from disttrain.metrics.time_to_target import ACCURACY, PERPLEXITY, Evaluation, TimeToTarget, perplexity_of

SUMMARY_FILE = "summary.json"
LANGUAGE_MODEL = "language-model"  # the task whose summary reports perplexity (data.description's)


@dataclass(frozen=True)
class Outcome:
    """What the final evaluation of a run found, and every evaluation on the way.

    Attributes:
        final_accuracy: the final model's test accuracy (a language model's: tokens right).
        final_loss: the final model's test loss.
        evaluations: `(train_time_s, figure)` of every evaluation of the run by the process
            writing the summary (`LoopResult.evaluations`): test accuracy for
            `time_to_accuracy_s`, a language model's test perplexity for
            `time_to_perplexity_s`; none means no target reached.
        task: the data set's; a language model's summary adds `task`, `final_perplexity`
            and `time_to_perplexity_s`, and shows perplexity in place of accuracy.
    """

    final_accuracy: float
    final_loss: float
    evaluations: tuple[Evaluation, ...] = ()
    task: str = "classification"


@dataclass(frozen=True)
class Work:
    """How much a run did, and over how long.

    Attributes:
        samples_processed: the samples trained on by all the run's processes.
        steps: the run's steps (a parameter server's: its shards' version).
        world_size: the processes that trained.
        total_time_s: the run's wall-clock time.
        train_time_s: the longest training clock of the run's processes.
    """

    samples_processed: int
    steps: int
    world_size: int
    total_time_s: float
    train_time_s: float


@dataclass
class RunSummary:
    """The fields of `keys.SUMMARY`, plus strategy-specific figures in `extra` (written at
    the top level of summary.json beside the others).

    `time_to_accuracy_s` is empty in a language model's, which records
    `time_to_perplexity_s` in `extra` instead."""

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
    time_to_accuracy_s: dict[str, float | None]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, strategy: str, config: Any, outcome: Outcome, work: Work,
               extra: dict[str, Any] | None = None) -> RunSummary:
        """The summary of a finished run; the throughput is samples over the training clock.

        Args:
            strategy: the name the summary reports ("baseline", "ddp", "ps-sync").
            config: the run's `Config`.
            outcome: what the run's evaluations found.
            work: how much the run did, and over how long.
            extra: strategy-specific figures, written at the top level of summary.json.
        """
        time_to_accuracy_s = ACCURACY.times(outcome.evaluations)
        if outcome.task == LANGUAGE_MODEL:
            extra = {"task": outcome.task, "final_perplexity": perplexity_of(outcome.final_loss),
                     PERPLEXITY.field: PERPLEXITY.times(outcome.evaluations), **(extra or {})}
            time_to_accuracy_s = {}  # a language model's figure is perplexity
        return cls(strategy=strategy, dataset=config.training.dataset,
                   final_accuracy=outcome.final_accuracy, final_loss=outcome.final_loss,
                   total_time_s=work.total_time_s, train_time_s=work.train_time_s,
                   throughput_samples_per_s=work.samples_processed / max(work.train_time_s, 1e-9),
                   samples_processed=int(work.samples_processed), steps=int(work.steps),
                   epochs=config.training.num_epochs, world_size=work.world_size,
                   config=config.to_dict(), time_to_accuracy_s=time_to_accuracy_s,
                   extra=dict(extra or {}))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out

    @property
    def is_language_model(self) -> bool:
        return self.extra.get("task") == LANGUAGE_MODEL

    @property
    def time_to_perplexity_s(self) -> dict[str, float | None]:
        """A language model's times to each perplexity target; empty for a classifier."""
        times = self.extra.get(PERPLEXITY.field)
        return dict(times) if isinstance(times, dict) else {}

    @property
    def time_to_target(self) -> tuple[TimeToTarget, dict[str, float | None]]:
        """The figure this run is timed by (perplexity for a language model, else accuracy)
        and its times to each target."""
        if self.is_language_model:
            return PERPLEXITY, self.time_to_perplexity_s
        return ACCURACY, self.time_to_accuracy_s

    def lines(self) -> list[str]:
        """The summary as the command prints it."""
        quality = (f"Final Perplexity: {self.extra['final_perplexity']:.3f}" if self.is_language_model
                   else f"Final Accuracy: {self.final_accuracy * 100:.2f}%")
        return [
            f"Strategy: {self.strategy} (world size {self.world_size}, dataset {self.dataset})",
            quality,
            f"Final Loss: {self.final_loss:.4f}",
            f"Total Time: {self.total_time_s:.2f}s",
            f"Throughput: {self.throughput_samples_per_s:.1f} samples/s",
        ] + self._time_to_target_lines() + (
            [f"Gradient Compression: {self.extra['compression_ratio']:.1f}x fewer bytes "
             f"({self.extra['compression_bytes_sent'] / 1e6:.1f} MB sent)"]
            if "compression_ratio" in self.extra else []) + (
            [f"Pull Compression: {self.extra['compression_pull_ratio']:.1f}x fewer bytes "
             f"({self.extra['compression_bytes_received'] / 1e6:.1f} MB received, "
             f"{self.extra['bytes_sent'] / 1e6:.1f} MB sent)"]
            if "compression_pull_ratio" in self.extra else []) + self._local_update_lines() \
            + self._recovery_lines()

    def _local_update_lines(self) -> list[str]:
        """`Local updates: sync every 8 steps, outer nesterov (lr 0.7, momentum 0.9), 12 rounds`."""
        extra = self.extra
        if "local_rounds" not in extra:
            return []
        momentum = f", momentum {extra['outer_momentum']:g}" if extra["outer_momentum"] else ""
        return [f"Local updates: sync every {extra['sync_every']} steps, outer {extra['outer_optimizer']} "
                f"(lr {extra['outer_learning_rate']:g}{momentum}), {extra['local_rounds']} rounds"]

    def _time_to_target_lines(self) -> list[str]:
        """`Time to accuracy: 90% 1.2s, 95% 3.4s, 97% -, 98% -`, or a language model's
        `Time to perplexity: 32 0.4s, 16 1.2s, 8 -, 4 -` (none when not recorded)."""
        target, times = self.time_to_target
        if not times:
            return []
        return [f"Time to {target.name}: " + ", ".join(
            f"{target.label(float(key))} " + ("-" if seconds is None else f"{seconds:.1f}s")
            for key, seconds in times.items())]

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
        return lines + self._live_recovery_lines()

    def _live_recovery_lines(self) -> list[str]:
        """`Live recovery: group of ranks 0,2 training again 0.17s after the death (step 10)`,
        one line per re-forming of a DDP group (ddp.recovery live)."""
        lines = []
        for recovery in self.extra.get("live_recoveries", []):
            members = ",".join(str(slot) for slot in recovery["members"])
            if recovery["kind"] == "shrink":
                since = recovery.get("resume_s")
                when = "" if since is None else f" {since:.2f}s after the death"
                lines.append(f"Live recovery: ranks {members} training again{when} (step {recovery['step']})")
            else:
                since = recovery.get("rejoin_s")
                when = "" if since is None else f" {since:.2f}s after its restart"
                lines.append(f"Live recovery: ranks {members} together again{when} (step {recovery['step']})")
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
            OSError: the file cannot be read. ValueError: it is not a summary of this
                disttrain (one an earlier build wrote lacks fields), in one line.
        """
        path = Path(path)
        if path.is_dir():
            path = path / SUMMARY_FILE
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a run summary (expected a JSON object)")
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        missing = [name for name in fields if name not in data]
        if data.get("task") == LANGUAGE_MODEL and PERPLEXITY.field not in data:
            missing.append(PERPLEXITY.field)
        if missing:
            raise ValueError(f"{path} is not a run summary of this disttrain (it has no "
                             f"{', '.join(missing)}); if an earlier disttrain wrote it, run it again")
        return cls(**{name: data.pop(name) for name in fields}, extra=data)
