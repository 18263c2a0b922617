"""Final checkpoint validation: train the baseline, the parameter server (sync) and DDP on
one budget, load each final model file back the way `disttrain evaluate` does, and
check named properties, each true or false with its figures.

One budget means the same updates: the baseline trains on the global batch (the batch
size times the workers), as the parallel runs do together, for the same epochs.

A language model is judged by its perplexity where a classifier is by its accuracy: its
final model file must score the summary's loss, and the strategies' final perplexities
must agree within the tolerance as a fraction of the lowest (`perplexities_agree`).

A property that cannot be judged on this machine (the speed-up of N workers on fewer
than N cores) is written with `applies: false` and the reason, and does not count.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from disttrain.comparison.plan import equal_threads, parse_strategies
from disttrain.comparison.runner import Comparison, Display, RunRecord
from disttrain.config import Config
from disttrain.metrics.summary import RunSummary

logger = logging.getLogger(__name__)

STRATEGIES = "baseline,ps-sync,ddp"
SPEEDUP_WORKERS = 4  # the speed-up property is judged with this many workers
RESULT_FILE = "validation.json"
LOSS_RTOL = 1e-4  # a language model's final model file scores its summary's loss to this


@dataclass
class Property:
    """One checked statement: whether it holds, and the figures it was judged on."""

    name: str
    holds: bool
    figures: dict[str, Any] = field(default_factory=dict)
    applies: bool = True
    reason: str = ""


@dataclass
class Validation:
    """Every property of one validation run, and where its runs are."""

    folder: str
    properties: list[Property]

    @property
    def passed(self) -> bool:
        return all(p.holds for p in self.properties if p.applies)

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "passed": self.passed,
                "properties": {p.name: {k: v for k, v in asdict(p).items() if k != "name"}
                               for p in self.properties}}


def validate(config: Config, folder: Path, tolerance: float, timeout_s: float, command: list[str],
             display: Display) -> Validation:
    """Run the three strategies into `folder` and judge the properties.

    Args:
        config: the budget (data set, epochs, subsets, seed) and the workers.
        tolerance: the most two strategies' final test accuracies may differ by (a fraction);
            for a language model, their final perplexities, as a fraction of the lowest.
        timeout_s: the longest one run may take.
    """
    workers, batch_size = config.system.num_workers, config.training.batch_size
    # The baseline trains on the global batch, so all three make the same updates of the
    # same batches and their accuracies can be held to a tolerance.
    baseline, *parallel = parse_strategies(STRATEGIES, workers)
    global_batch = (("training.batch_size", str(batch_size * workers)),)
    runs = [dataclasses.replace(baseline, overrides=global_batch), *parallel]
    config = equal_threads(config, runs)
    records = Comparison(folder, config, runs, command, timeout_s).run(display)
    properties: list[Property] = []
    accuracies: dict[str, float] = {}
    perplexities: dict[str, float] = {}
    speeds: dict[str, float] = {}
    for record in records:
        properties.append(Property(f"{_key(record.name)}_finished", record.status == "ok",
                                   {"error": record.error, "wall_time_s": record.wall_time_s}))
        if record.status != "ok":
            continue
        summary = RunSummary.read(folder / record.log_dir)
        accuracies[record.name] = summary.final_accuracy
        if summary.is_language_model:
            perplexities[record.name] = summary.extra["final_perplexity"]
        speeds[record.name] = summary.throughput_samples_per_s
        properties.append(_checkpoint_matches(record, summary, folder, config))
        if "samples_lost" in summary.extra:
            lost = summary.extra["samples_lost"]
            properties.append(Property(f"{_key(record.name)}_no_samples_lost", lost == 0, {
                "samples_applied": summary.extra.get("samples_applied"), "samples_lost": lost}))
    batches = {"baseline_batch_size": batch_size * workers, "batch_size_per_worker": batch_size}
    if perplexities and len(perplexities) == len(records):
        spread = (max(perplexities.values()) - min(perplexities.values())) / min(perplexities.values())
        properties.append(Property("perplexities_agree", spread <= tolerance, {
            "final_perplexity": perplexities, "relative_spread": spread, "tolerance": tolerance, **batches}))
    elif len(accuracies) == len(records):
        spread = max(accuracies.values()) - min(accuracies.values())
        properties.append(Property("accuracies_agree", spread <= tolerance, {
            "final_accuracy": accuracies, "spread": spread, "tolerance": tolerance, **batches}))
    properties += _speedups(speeds, config.system.num_workers)
    return Validation(str(folder), properties)


def _key(name: str) -> str:
    return name.replace("-", "_").replace("+", "_")


def _checkpoint_matches(record: RunRecord, summary: RunSummary, folder: Path, config: Config) -> Property:
    """The final model file, loaded with weights only, scores what the summary says."""
    from disttrain.training.evaluation import evaluate_model_file
    name = f"{_key(record.name)}_checkpoint_matches_summary"
    files = sorted((folder / record.name / "checkpoints").glob("*_final.pt"))
    if len(files) != 1:
        return Property(name, False, {"final_model_files": [str(f) for f in files]},
                        reason="expected exactly one *_final.pt in the run's checkpoint folder")
    result = evaluate_model_file(files[0], config.training)
    # Both are counts of right answers over the same test predictions (samples, or a
    # language model's tokens): equal means the same count.
    same = abs(result.accuracy - summary.final_accuracy) * result.predictions < 0.5
    figures = {"final_model": str(files[0]), "evaluated_accuracy": result.accuracy,
               "summary_accuracy": summary.final_accuracy, "test_samples": result.num_samples}
    if summary.is_language_model:
        # The loss is a mean of floats summed in another order when ranks evaluate their
        # parts: equal to float32's rounding, not bit for bit.
        same = same and abs(result.loss - summary.final_loss) <= LOSS_RTOL * max(1.0, abs(result.loss))
        figures.update(evaluated_perplexity=result.perplexity,
                       summary_perplexity=summary.extra["final_perplexity"])
    return Property(name, same, figures)


def _speedups(speeds: dict[str, float], workers: int) -> list[Property]:
    """Each parallel strategy's samples/s over the baseline's, judged with 4 workers on a
    machine with a core for each."""
    baseline = speeds.get("baseline")
    cores = os.cpu_count() or 1
    properties = []
    for name, speed in speeds.items():
        if name == "baseline" or not baseline:
            continue
        speedup = speed / baseline
        figures = {"samples_per_s": speed, "baseline_samples_per_s": baseline, "speedup": speedup,
                   "workers": workers, "cpu_cores": cores}
        prop = Property(f"{_key(name)}_speedup_over_baseline", speedup > 1.0, figures)
        if workers != SPEEDUP_WORKERS:
            prop.applies, prop.reason = False, f"judged with --workers {SPEEDUP_WORKERS} only"
        elif cores < workers:
            prop.applies, prop.reason = False, (
                f"this machine has {cores} CPU cores for {workers} workers: they share the cores, "
                f"so no speed-up can be shown here; run on a machine with >= {workers} cores")
        properties.append(prop)
    return properties
