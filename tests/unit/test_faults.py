"""Fault specs parse strictly and fire only where they are meant to."""

import pytest

from disttrain.faults import Fault, FaultInjector, parse_fault


def test_parse():
    assert parse_fault("kill@step=30") == Fault("kill", 30)
    assert parse_fault("kill@step=5,rank=1,attempt=2") == Fault("kill", 5, rank=1, attempt=2)


@pytest.mark.parametrize("text", ["kill", "explode@step=3", "kill@rank=1", "kill@step=x"])
def test_bad_specs(text):
    with pytest.raises(ValueError):
        parse_fault(text)


def test_selection_by_rank_and_attempt():
    faults = [Fault("kill", 3, rank=1, attempt=0)]
    assert FaultInjector(faults, rank=0)._faults == []
    assert FaultInjector(faults, rank=1, attempt=1)._faults == []
    assert FaultInjector(faults, rank=1, attempt=0)._faults == faults
