"""Time to a target: the training-clock time at which a run's test figure first reached
each of its targets. A classifier's test accuracy rises to `keys.ACCURACY_THRESHOLDS`
(`ACCURACY`); a language model's test perplexity falls to `keys.PERPLEXITY_TARGETS`
(`PERPLEXITY`). One rule serves both (`first_reached`), only the direction differs.

A pure computation over the run's evaluations, `(train_time_s, figure)` pairs in the
order they happened. The loop collects them as it evaluates and reads back those made
before a resume from the records `metrics.jsonl` kept (`TimeToTarget.evaluations_from_records`),
so a resumed run reports the same times as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.metrics.keys import ACCURACY_THRESHOLDS, PERPLEXITY_TARGETS


def perplexity_of(loss: float) -> float:
    """exp(mean cross-entropy): what a language model reports instead of accuracy; inf
    past e^700, where a float overflows."""
    return math.exp(min(loss, 700.0))

Evaluation = tuple[float, float]  # (training-clock seconds, the test figure: accuracy or perplexity)

UP, DOWN = "up", "down"  # a target is reached at or above it (UP), or at or below it (DOWN)


def first_reached(evaluations: Iterable[Evaluation], targets: Sequence[float],
                  direction: str) -> list[float | None]:
    """The training-clock time of the first evaluation whose figure reached each target.

    Args:
        evaluations: `(train_time_s, figure)` of every evaluation, in the order made.
        targets: the figures to reach.
        direction: `UP` (reached when the figure is >= the target, as accuracy) or `DOWN`
            (reached when it is <= the target, as perplexity).

    Returns:
        One entry per target, in the order of `targets`: seconds, or None where no
        evaluation reached it. A later evaluation falling back does not undo a reach.

    Raises:
        ValueError: `direction` is neither UP nor DOWN.
    """
    if direction not in (UP, DOWN):
        raise ValueError(f"direction should be {UP!r} or {DOWN!r}, not {direction!r}")
    sign = 1.0 if direction == UP else -1.0  # compare -figure >= -target for DOWN
    reached: list[float | None] = [None] * len(targets)
    for train_time_s, figure in evaluations:
        for i, target in enumerate(targets):
            if reached[i] is None and sign * figure >= sign * target:
                reached[i] = float(train_time_s)
    return reached


@dataclass(frozen=True)
class TimeToTarget:
    """A test figure whose time to reach each of `targets` a run summary records.

    Attributes:
        name: the figure, in words ("accuracy").
        field: the summary's field (and a report row's) holding the times.
        metric: the evaluation records' key of the figure.
        final_field: the summary's field of the final figure.
        targets: the figures to reach, in the order they are shown.
        direction: `UP` or `DOWN` (see `first_reached`).
        key_format: how a target is spelt as a key of `field` ("0.90", "16").
        percent: the figure is a fraction people read as a percentage.
    """

    name: str
    field: str
    metric: str
    final_field: str
    targets: tuple[float, ...]
    direction: str
    key_format: str
    percent: bool = False

    def key(self, target: float) -> str:
        """The key of `target` in the summary's `field`."""
        return f"{target:{self.key_format}}"

    def label(self, target: float) -> str:
        """`target` as people write the figure: "90%" (accuracy), "16" (perplexity)."""
        return f"{target * 100:g}%" if self.percent else f"{target:g}"

    def with_targets(self, targets: Iterable[float]) -> TimeToTarget:
        """The same figure with other targets (a comparison's own)."""
        return dataclasses.replace(self, targets=tuple(float(t) for t in targets))

    def times(self, evaluations: Iterable[Evaluation]) -> dict[str, float | None]:
        """`key(t)` -> seconds until the first evaluation reached `t`, None where none did;
        every target has its key."""
        reached = first_reached(evaluations, self.targets, self.direction)
        return {self.key(t): seconds for t, seconds in zip(self.targets, reached, strict=True)}

    def better(self, figure: float) -> float:
        """A sort key putting better figures first (higher accuracy, lower perplexity)."""
        return -figure if self.direction == UP else figure

    def evaluations_from_records(self, records: Iterable[dict[str, Any]]) -> list[Evaluation]:
        """The evaluations among `metrics.jsonl` records: those with a finite `metric`
        (a non-finite one is written as null), each at its `progress/train_time_s`, which
        every evaluation record carries (`training.loop.evaluation_record`).

        Raises:
            ValueError: an evaluation record without the training clock's reading.
        """
        found = []
        for record in records:
            figure = record.get(self.metric)
            if figure is None:
                continue
            if record.get("progress/train_time_s") is None:
                raise ValueError(f"the evaluation record of step {record.get('step')} has no "
                                 "progress/train_time_s; every evaluation record carries it")
            found.append((float(record["progress/train_time_s"]), float(figure)))
        return found


ACCURACY = TimeToTarget("accuracy", "time_to_accuracy_s", "accuracy/test", "final_accuracy",
                        ACCURACY_THRESHOLDS, UP, ".2f", percent=True)
PERPLEXITY = TimeToTarget("perplexity", "time_to_perplexity_s", "perplexity/test", "final_perplexity",
                          PERPLEXITY_TARGETS, DOWN, "g")


def time_to_target(perplexity: bool) -> TimeToTarget:
    """The figure a run times: a language model's perplexity, else a classifier's accuracy."""
    return PERPLEXITY if perplexity else ACCURACY
