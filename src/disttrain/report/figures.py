"""The figures a comparison reports per run, and the rankings between runs.

A row is one run's figures as a JSON-ready dict (the shape of a run in report.json).
Speed-up is a run's samples/s over the baseline run's; scaling efficiency is the
speed-up over the run's workers (1.0: every worker as fast as the one baseline process).
Times to an accuracy are on the training clock of the evaluating process: the first
evaluation at or above the threshold; a language model's times to a perplexity, the
first at or below the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disttrain.metrics.time_to_target import ACCURACY, PERPLEXITY, TimeToTarget
from disttrain.report.digest import mean_of, process_digest
from disttrain.report.runs import Evaluation, RunData, finite, is_number

BASELINE_NAME = "baseline"
OK, FAILED, PENDING = "ok", "failed", "pending"
STATUSES = (OK, FAILED, PENDING)

# row field -> digest field: the mean time per step and its split, over the processes
STEP_TIME_FIELDS = {"step_s": "step_time_s", "compute_s": "compute_s",
                    "comm_blocked_s": "comm_blocked_s", "compression_s": "compression_s"}


def run_time_to_target(evaluated: Sequence[Evaluation], target: TimeToTarget,
                       recorded: Any = None) -> dict[str, float | None]:
    """Training-clock seconds until the first evaluation reached each of `target.targets`:
    the summary's own figure where it has one, else (a target the run did not time: the
    report's thresholds are its own) from the evaluations in the metrics.

    Args:
        evaluated: the run's evaluations, in order.
        target: the figure and its targets (accuracy thresholds, perplexity targets).
        recorded: the summary's `target.field`.

    Returns:
        target key -> seconds, None where no evaluation reached it.
    """
    recorded = recorded if isinstance(recorded, dict) else {}
    figures = [(e.train_time_s, e.figure(target.metric)) for e in evaluated]
    computed = target.times([(time, figure) for time, figure in figures
                             if time is not None and figure is not None])
    known = {key: finite(value) for key, value in recorded.items() if value is None or is_number(value)}
    return {key: known[key] if key in known else seconds for key, seconds in computed.items()}


def run_row(entry: dict[str, Any], run: RunData | None, thresholds: Sequence[float],
            perplexity_targets: Sequence[float] = PERPLEXITY.targets) -> dict[str, Any]:
    """One run's row: what comparison.json says of it, and its figures when it finished.

    Args:
        entry: the run's entry in comparison.json (name, strategy, compression, workers,
            status, error, log_dir).
        run: its run folder, None for a failed or pending run.
        thresholds: the test accuracies to time (`time_to_accuracy_s`).
        perplexity_targets: the test perplexities to time (`time_to_perplexity_s`; only
            a language model reaches any).

    Returns:
        The row; figures are None for a run that did not finish; speedup and
        scaling_efficiency are filled in by `add_speedups`.
    """
    targets = (ACCURACY.with_targets(thresholds), PERPLEXITY.with_targets(perplexity_targets))
    summary = run.summary if run is not None else {}
    row: dict[str, Any] = {
        "name": entry["name"], "strategy": entry.get("strategy") or summary.get("strategy"),
        "compression": entry.get("compression"), "status": entry.get("status", OK),
        "error": entry.get("error"),
        "workers": int(entry.get("workers") or summary.get("world_size") or 1),
        "log_dir": entry.get("log_dir"),
    }
    if run is None:
        return {**row, **dict.fromkeys(("final_accuracy", "final_perplexity", "final_loss", "total_time_s",
                                        "train_time_s",
                                        "samples_per_s", "speedup", "scaling_efficiency", "bytes_per_step",
                                        "push_bytes_per_step", "pull_bytes_per_step", "compression_ratio",
                                        "compression_pull_ratio", "recovery_events",
                                        "staleness_histogram")),
                **{target.field: dict.fromkeys(map(target.key, target.targets)) for target in targets},
                "step_time": dict.fromkeys(STEP_TIME_FIELDS),
                "series": {"process": None, "test": [], "train": []}}
    digests = [process_digest(name, records) for name, records in run.processes.items()]
    evaluated = run.evaluations()
    return {
        **row,
        "final_accuracy": finite(summary["final_accuracy"]),
        "final_perplexity": finite(summary.get("final_perplexity")),  # a language model's
        "final_loss": finite(summary["final_loss"]),
        **{target.field: run_time_to_target(evaluated, target, summary.get(target.field))
           for target in targets},
        "total_time_s": finite(summary["total_time_s"]),
        "train_time_s": finite(summary["train_time_s"]),
        "samples_per_s": finite(summary["throughput_samples_per_s"]),
        "speedup": None,
        "scaling_efficiency": None,
        "bytes_per_step": mean_of(digests, "wire_bytes_per_step"),
        # A PS worker's split of them: gradients pushed, parameters pulled (None elsewhere).
        "push_bytes_per_step": mean_of(digests, "bytes_sent_per_step"),
        "pull_bytes_per_step": mean_of(digests, "bytes_received_per_step"),
        "compression_ratio": finite(summary.get("compression_ratio")),
        "compression_pull_ratio": finite(summary.get("compression_pull_ratio")),
        "recovery_events": int(summary.get("num_failures") or 0),
        "step_time": {name: mean_of(digests, field) for name, field in STEP_TIME_FIELDS.items()},
        "staleness_histogram": staleness_histogram(summary),
        "series": {
            "process": run.evaluating_process,
            "test": [{"step": e.step, "epoch": e.epoch, "train_time_s": e.train_time_s,
                      "accuracy": e.accuracy, "loss": e.loss, "perplexity": e.perplexity}
                     for e in evaluated],
            "train": [{"step": w.step, "train_time_s": w.train_time_s, "loss": w.loss,
                       "accuracy": w.accuracy, "perplexity": w.perplexity} for w in run.train_windows()],
        },
    }


def staleness_histogram(summary: dict[str, Any]) -> dict[str, int] | None:
    """The PS staleness histogram ({"0": pushes, "1": ...}, by staleness) or None."""
    histogram = summary.get("staleness_histogram")
    if not isinstance(histogram, dict) or not histogram:
        return None
    counts = {str(key): int(value) for key, value in histogram.items() if is_number(value)}
    return dict(sorted(counts.items(), key=lambda item: int(item[0]) if item[0].isdigit() else 0))


def baseline_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished run the others are measured against: the one named "baseline", else the
    first finished run of the baseline strategy; None when there is none."""
    finished = [row for row in rows if row["status"] == OK and row["samples_per_s"]]
    named = [row for row in finished if row["name"] == BASELINE_NAME]
    strategy = [row for row in finished if row["strategy"] == BASELINE_NAME]
    return (named or strategy or [None])[0]


def add_speedups(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Fill in each finished row's speedup and scaling_efficiency (left None without a
    finished baseline run).

    Returns:
        The baseline row used, or None.
    """
    base = baseline_row(rows)
    for row in rows:
        if base is None or row["status"] != OK or row["samples_per_s"] is None:
            continue
        row["speedup"] = speedup(row["samples_per_s"], base["samples_per_s"])
        row["scaling_efficiency"] = scaling_efficiency(row["speedup"], row["workers"])
    return base


def speedup(samples_per_s: float, baseline_samples_per_s: float) -> float | None:
    """samples/s over the baseline's; None when the baseline has none."""
    return samples_per_s / baseline_samples_per_s if baseline_samples_per_s else None


def scaling_efficiency(speedup_: float | None, workers: int) -> float | None:
    """The speed-up per worker: 1.0 is linear scaling."""
    return speedup_ / workers if speedup_ is not None and workers else None


def rankings(rows: Sequence[dict[str, Any]], target: TimeToTarget) -> dict[str, Any]:
    """The finished runs' names in order: for each of `target.targets`, those that
    reached it, fastest first, then those that did not, best final figure first (highest
    accuracy, lowest perplexity); and by samples/s, fastest first. Failed and pending
    runs are left out.

    Returns:
        {"time_to_accuracy" (or "time_to_perplexity"): {target key: [names]},
        "samples_per_s": [names]}.
    """
    finished = [row for row in rows if row["status"] == OK]
    by_time = {}
    for key in map(target.key, target.targets):
        reached = sorted((row for row in finished if row[target.field].get(key) is not None),
                         key=lambda row, key=key: row[target.field][key])
        missed = sorted((row for row in finished if row[target.field].get(key) is None),
                        key=lambda row: _final_rank(row.get(target.final_field), target))
        by_time[key] = [row["name"] for row in reached + missed]
    by_speed = sorted(finished, key=lambda row: -(row["samples_per_s"] or 0.0))
    return {ranking_key(target): by_time, "samples_per_s": [row["name"] for row in by_speed]}


def ranking_key(target: TimeToTarget) -> str:
    """The key of `target`'s ranking in `rankings`: "time_to_accuracy", "time_to_perplexity"."""
    return target.field.removesuffix("_s")


def _final_rank(figure: float | None, target: TimeToTarget) -> tuple[bool, float]:
    """Best final figure first; runs without one last."""
    return (figure is None, 0.0 if figure is None else target.better(figure))
