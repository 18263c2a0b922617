"""Run folders and comparison folders for report tests, written with the real
`MetricsLogger` and `RunSummary`: every figure a report shows follows from the few numbers
given here (a constant step time, bytes per step, one accuracy, or a language model's
one perplexity, per epoch)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from disttrain.config import config_from_dict
from disttrain.metrics.logger import MetricsLogger
from disttrain.metrics.summary import Outcome, RunSummary, Work

STEPS_PER_EPOCH = 10
LOG_INTERVAL = 5
BATCH_SIZE = 32


@dataclass
class FakeRun:
    """What a run did: each process trains `STEPS_PER_EPOCH` steps of `BATCH_SIZE` samples
    per epoch at `step_s` a step (`comm_s` of it blocked on communication), logs a window
    every `LOG_INTERVAL` steps and, if it evaluates, one accuracy per epoch (a language
    model, `perplexities` given: one perplexity per epoch, and no accuracy logged).

    Attributes:
        processes: the process folders (`baseline`, `worker0`, ...); the first evaluates.
        scalars: per-step metric values every window also logs (bytes, compression time).
        eval_clock: also write `progress/train_time_s` into the evaluation records.
        summary_times: the summary records `time_to_accuracy_s` (a language model's
            `time_to_perplexity_s`; False: a summary written before it existed, so a
            report finds the times in the metrics).
    """

    strategy: str
    processes: list[str]
    step_s: float
    accuracies: list[float]
    comm_s: float = 0.0
    scalars: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    eval_clock: bool = False
    summary_times: bool = True
    perplexities: list[float] = field(default_factory=list)

    @property
    def language_model(self) -> bool:
        return bool(self.perplexities)

    @property
    def figures(self) -> list[float]:
        """The test figure of each epoch: perplexity for a language model, else accuracy."""
        return self.perplexities or self.accuracies

    @property
    def num_steps(self) -> int:
        return STEPS_PER_EPOCH * len(self.figures)

    @property
    def samples_per_s(self) -> float:
        return len(self.processes) * BATCH_SIZE / self.step_s

    def clock_at(self, step: int) -> float:
        return step * self.step_s


def write_run(log_dir: Path, run: FakeRun) -> RunSummary:
    """Write `run`'s metrics and summary.json into `log_dir`."""
    for index, name in enumerate(run.processes):
        with MetricsLogger(log_dir / name, tensorboard=False) as metrics:
            for step in range(1, run.num_steps + 1):
                epoch = (step - 1) // STEPS_PER_EPOCH
                if step % LOG_INTERVAL == 0:
                    quality = ({"perplexity/train": run.perplexities[epoch] * 1.1} if run.language_model
                               else {"accuracy/train": run.accuracies[epoch] * 0.9})
                    metrics.log(step, epoch, {
                        "loss/train": 2.0 / step, **quality,
                        "throughput/samples_per_s": BATCH_SIZE / run.step_s, "time/step_s": run.step_s,
                        "time/compute_s": run.step_s - run.comm_s, **run.scalars,
                        **({"time/comm_blocked_s": run.comm_s} if run.comm_s else {}),
                        "progress/samples": step * BATCH_SIZE, "progress/train_time_s": run.clock_at(step)})
                if step % STEPS_PER_EPOCH == 0 and index == 0:
                    quality = ({"perplexity/test": run.perplexities[epoch],
                                "loss/test": math.log(run.perplexities[epoch])} if run.language_model
                               else {"accuracy/test": run.accuracies[epoch],
                                     "loss/test": 1.0 - run.accuracies[epoch]})
                    metrics.log(step, epoch, {
                        **quality, "time/eval_s": 0.5,
                        **({"progress/train_time_s": run.clock_at(step)} if run.eval_clock else {})})
    config = config_from_dict({"system": {"log_dir": str(log_dir)},
                               "training": {"num_epochs": len(run.figures), "dataset": "digits"}})
    outcome = Outcome(
        final_accuracy=0.3 if run.language_model else run.accuracies[-1],  # a language model's: tokens right
        final_loss=math.log(run.perplexities[-1]) if run.language_model else 1.0 - run.accuracies[-1],
        evaluations=tuple((run.clock_at((epoch + 1) * STEPS_PER_EPOCH), figure)
                          for epoch, figure in enumerate(run.figures)),
        task="language-model" if run.language_model else "classification")
    work = Work(samples_processed=len(run.processes) * run.num_steps * BATCH_SIZE, steps=run.num_steps,
                world_size=len(run.processes), total_time_s=run.clock_at(run.num_steps) + 3.0,
                train_time_s=run.clock_at(run.num_steps))
    summary = RunSummary.create(run.strategy, config, outcome, work, extra=run.extra)
    path = summary.write(log_dir)
    if not run.summary_times:
        data = json.loads(path.read_text())
        del data["time_to_perplexity_s" if run.language_model else "time_to_accuracy_s"]
        path.write_text(json.dumps(data))
    return summary


BASELINE = FakeRun("baseline", ["baseline"], step_s=0.04, accuracies=[0.6, 0.91, 0.955], summary_times=False)
PS_SYNC = FakeRun("ps-sync", ["worker0", "worker1"], step_s=0.05, comm_s=0.02, accuracies=[0.5, 0.85, 0.92],
                  scalars={"comm/bytes_sent": 200_000.0, "comm/bytes_received": 210_000.0,
                           "ps/staleness": 0.0},
                  extra={"staleness_histogram": {"0": 50, "1": 10}, "num_failures": 1})
DDP = FakeRun("ddp", ["rank0", "rank1"], step_s=0.03, comm_s=0.01, accuracies=[0.7, 0.95, 0.97],
              scalars={"comm/bytes_allreduced": 200_000.0}, eval_clock=True, summary_times=False)
DDP_TOPK = FakeRun("ddp", ["rank0", "rank1"], step_s=0.025, comm_s=0.005, accuracies=[0.7, 0.9, 0.93],
                   scalars={"comm/bytes_allreduced": 200_000.0, "compression/bytes_sent": 4_000.0,
                            "compression/bytes_dense": 200_000.0, "time/compression_s": 0.002},
                   extra={"compression_ratio": 50.0, "compression_bytes_sent": 4_000.0 * 60})
RUNS = {"baseline": BASELINE, "ps-sync": PS_SYNC, "ddp": DDP, "ddp+topk": DDP_TOPK}
THRESHOLDS = [0.9, 0.95, 0.97, 0.98]
PERPLEXITY_TARGETS = [32, 16, 8, 4]

# Language models on byte-level text: perplexity per epoch, timed to `PERPLEXITY_TARGETS`.
LM_BASELINE = FakeRun("baseline", ["baseline"], step_s=0.04, accuracies=[], perplexities=[40.0, 14.0, 7.5])
LM_PS_SYNC = FakeRun("ps-sync", ["worker0", "worker1"], step_s=0.05, comm_s=0.02, accuracies=[],
                     perplexities=[60.0, 30.0, 17.0], scalars={"comm/bytes_sent": 200_000.0,
                                                              "comm/bytes_received": 210_000.0},
                     summary_times=False)
LM_DDP = FakeRun("ddp", ["rank0", "rank1"], step_s=0.03, comm_s=0.01, accuracies=[],
                 perplexities=[31.0, 20.0, 9.0], scalars={"comm/bytes_allreduced": 200_000.0},
                 eval_clock=True)
LM_RUNS = {"baseline": LM_BASELINE, "ps-sync": LM_PS_SYNC, "ddp": LM_DDP}


def write_comparison(folder: Path, runs: dict[str, FakeRun] | None = None,
                     failed: dict[str, str] | None = None) -> Path:
    """A comparison folder as `disttrain compare` leaves it: every run of `runs` finished
    under `<name>/logs`, every one of `failed` (name -> error) failed."""
    runs = RUNS if runs is None else runs
    entries = []
    for name, run in runs.items():
        write_run(folder / name / "logs", run)
        entries.append({"name": name, "strategy": run.strategy,
                        "compression": "topk" if "topk" in name else None, "workers": len(run.processes),
                        "status": "ok", "error": None, "log_dir": f"{name}/logs", "wall_time_s": 10.0,
                        "command": ["disttrain", run.strategy]})
    for name, error in (failed or {}).items():
        entries.append({"name": name, "strategy": name.split("+")[0], "compression": None, "workers": 2,
                        "status": "failed", "error": error, "log_dir": f"{name}/logs", "wall_time_s": 1.0,
                        "command": ["disttrain", "ps"]})
    (folder / "comparison.json").write_text(json.dumps({
        "version": 1, "created": "2026-12-01T04:00:00+00:00", "command": ["disttrain", "compare"],
        "dataset": "digits", "thresholds": THRESHOLDS, "perplexity_targets": PERPLEXITY_TARGETS,
        "runs": entries}))
    return folder
