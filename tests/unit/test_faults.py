"""Fault specs parse strictly and fire only where they are meant to."""

import pytest

from disttrain.core.faults import Fault, FaultInjector, parse_fault


def test_parse():
    assert parse_fault("kill@step=30") == Fault("kill", 30)
    assert parse_fault("kill@step=5,rank=1,attempt=2") == Fault("kill", 5, rank=1, attempt=2)
    assert parse_fault("slow-eval@seconds=1.5") == Fault("slow-eval", seconds=1.5)


@pytest.mark.parametrize("text", ["kill", "explode@step=3", "kill@rank=1", "kill@step=x",
                                  "slow-eval@step=3", "slow-eval@seconds=-1", "kill@step=3,color=2"])
def test_bad_specs(text):
    with pytest.raises(ValueError):
        parse_fault(text)


def test_selection_by_rank_and_attempt():
    faults = [Fault("kill", 3, rank=1, attempt=0)]
    assert FaultInjector(faults, rank=0)._faults == []
    assert FaultInjector(faults, rank=1, attempt=1)._faults == []
    assert FaultInjector(faults, rank=1, attempt=0)._faults == faults


def test_slow_evaluation_waits_where_it_is_meant_to(monkeypatch):
    slept = []
    monkeypatch.setattr("disttrain.core.faults.time.sleep", slept.append)
    FaultInjector([Fault("slow-eval", seconds=2.0, rank=1)], rank=0).at_evaluation()
    FaultInjector([Fault("slow-eval", seconds=2.0, rank=1)], rank=1).at_evaluation()
    FaultInjector([Fault("kill", 3)], rank=1).at_evaluation()
    assert slept == [2.0]
