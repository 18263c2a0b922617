"""What a node reports, as typed values: a balance state refuses negative figures, and
the latest metrics merge each record into a new immutable value, keeping keys not in the
record and leaving out what is not a finite number."""

from __future__ import annotations

import math

import pytest

from disttrain.coordinator.reports import BalanceState, LatestMetrics, NodeMetrics, NodeProgress


def test_a_balance_state_defaults_to_unknown_and_refuses_negative_figures():
    assert BalanceState() == BalanceState(0, 0.0, 0)
    for bad in ({"batch_size": -1}, {"warmup_speed": -0.5}, {"warmup_speed": math.nan}, {"plans": -2}):
        with pytest.raises(ValueError, match="balance state"):
            BalanceState(**bad)


def test_values_are_immutable():
    progress = NodeProgress(0, 3, 96)
    with pytest.raises(AttributeError):
        progress.step = 4
    assert (progress.work_s, progress.balance) == (None, None)
    with pytest.raises(AttributeError):
        BalanceState(64, 1.0, 1).plans = 2


def test_latest_metrics_keep_the_newest_value_of_every_key():
    latest = LatestMetrics()
    assert latest.latest() is None
    latest.publish(10, 0, {"loss/train": 0.9, "throughput/samples_per_s": 400.0})
    first = latest.latest()
    latest.publish(12, 0, {"loss/test": 0.7, "accuracy/test": 0.81})
    latest.publish(20, 1, {"loss/train": 0.5, "throughput/samples_per_s": 420.0})
    newest = latest.latest()
    assert newest == NodeMetrics(20, 1, {"loss/train": 0.5, "throughput/samples_per_s": 420.0,
                                         "loss/test": 0.7, "accuracy/test": 0.81})
    assert first is not newest and first.scalars == {"loss/train": 0.9, "throughput/samples_per_s": 400.0}
    with pytest.raises(TypeError):  # a reader cannot change what the next report sends
        newest.scalars["loss/train"] = 0.0


def test_non_finite_values_and_non_numbers_are_left_out():
    latest = LatestMetrics()
    latest.publish(1, 0, {"loss/train": 0.4})
    latest.publish(2, 0, {"loss/train": math.nan, "accuracy/train": math.inf, "time/step_s": 0.01,
                          "note": "text"})
    assert dict(latest.latest().scalars) == {"loss/train": 0.4, "time/step_s": 0.01}
    assert latest.latest().step == 2
