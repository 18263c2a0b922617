"""Time to accuracy: the training-clock time at which a run's test accuracy first reached
each of `keys.ACCURACY_THRESHOLDS`.

A pure computation over the run's evaluations, `(train_time_s, accuracy)` pairs in the
order they happened. The loop collects them as it evaluates and reads back those made
before a resume from the records `metrics.jsonl` kept (`evaluations_from_records`), so a
resumed run reports the same times as one that never stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from disttrain.metrics.keys import ACCURACY_THRESHOLDS

Evaluation = tuple[float, float]  # (training-clock seconds, test accuracy)


def threshold_key(threshold: float) -> str:
    """The summary's key for a threshold: two decimals ("0.90")."""
    return f"{threshold:.2f}"


def time_to_accuracy(evaluations: Iterable[Evaluation],
                     thresholds: Sequence[float] = ACCURACY_THRESHOLDS) -> dict[str, float | None]:
    """The training-clock time of the first evaluation whose accuracy reached each threshold.

    Args:
        evaluations: `(train_time_s, accuracy)` of every evaluation, in the order made.
        thresholds: fractions of the test set classified right.

    Returns:
        `threshold_key(t)` -> seconds, or None where no evaluation reached `t`; every
        threshold has its key.
    """
    reached: dict[str, float | None] = {threshold_key(t): None for t in thresholds}
    for train_time_s, accuracy in evaluations:
        for t in thresholds:
            key = threshold_key(t)
            if reached[key] is None and accuracy >= t:
                reached[key] = float(train_time_s)
    return reached


def evaluations_from_records(records: Iterable[dict[str, Any]]) -> list[Evaluation]:
    """The evaluations among `metrics.jsonl` records: those with both `accuracy/test` and
    `progress/train_time_s` (records written before evaluations carried the training
    clock have no time and are left out)."""
    found = []
    for record in records:
        accuracy, train_time_s = record.get("accuracy/test"), record.get("progress/train_time_s")
        if accuracy is not None and train_time_s is not None:
            found.append((float(train_time_s), float(accuracy)))
    return found
