"""The validation's verdict: which properties count, and when the speed-up is judged."""

import pytest

from disttrain.comparison import validate as validation
from disttrain.comparison.validate import Property, Validation


def test_only_properties_that_apply_decide_the_verdict():
    passing = Validation("f", [Property("a", True), Property("b", False, applies=False, reason="why")])
    assert passing.passed
    assert passing.to_dict()["properties"]["b"] == {"holds": False, "figures": {}, "applies": False,
                                                    "reason": "why"}
    assert not Validation("f", [Property("a", True), Property("c", False)]).passed


@pytest.mark.parametrize(("workers", "cores", "applies", "says"), [
    (4, 8, True, ""),
    (4, 2, False, "2 CPU cores for 4 workers"),
    (2, 8, False, "--workers 4 only"),
])
def test_the_speedup_is_judged_with_four_workers_on_a_core_each(monkeypatch, workers, cores, applies, says):
    monkeypatch.setattr(validation.os, "cpu_count", lambda: cores)
    ps, ddp = validation._speedups({"baseline": 100.0, "ps-sync": 250.0, "ddp": 90.0}, workers)
    assert (ps.name, ps.holds, ps.figures["speedup"]) == ("ps_sync_speedup_over_baseline", True, 2.5)
    assert (ddp.name, ddp.holds) == ("ddp_speedup_over_baseline", False)
    assert ps.applies == ddp.applies == applies and says in ps.reason
