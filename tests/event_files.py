"""A process's metrics as TensorBoard reads them back (its own event reader), set beside
the process's metrics.jsonl: the two must hold the same scalars at the same steps."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from disttrain.metrics.logger import METRICS_FILE, read_metrics

RECORD_FIELDS = {"step", "epoch", "time"}  # every record's own fields, not metrics


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in `folder` -> its (step, value) in writing order,
    as TensorBoard shows them (its purges of redone steps applied)."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def jsonl_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The same from `folder`'s metrics.jsonl, each value rounded to float32 as TensorBoard
    stores it (a non-finite value, null in JSON, reads back as NaN)."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(folder / METRICS_FILE):
        for key in record.keys() - RECORD_FIELDS:
            value = math.nan if record[key] is None else torch.tensor(record[key], dtype=torch.float32).item()
            scalars.setdefault(key, []).append((record["step"], value))
    return scalars


def assert_tensorboard_mirrors_jsonl(folder: Path) -> set[str]:
    """Assert TensorBoard reads back every key of `folder`'s metrics.jsonl, at the same
    steps with the same values, and nothing else. Returns the keys."""
    expected, actual = jsonl_scalars(folder), tensorboard_scalars(folder)
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    for key, points in expected.items():
        # NaN != NaN: compare through repr, which spells it "nan" on both sides.
        assert repr(actual[key]) == repr(points), (folder.name, key, actual[key], points)
    return set(expected)
