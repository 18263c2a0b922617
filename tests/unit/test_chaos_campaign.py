"""A campaign's JSON from its results: counts by outcome, slowdown over the runs that
finished, the longest recovery, the faults drawn, and every violation with its schedule."""

from __future__ import annotations

from disttrain.chaos.campaign import summarize
from disttrain.chaos.runner import Reference


def result(scenario, seed, outcome, slowdown=1.5, recovery=None, violations=(),
           schedule=("kill:worker=1:step=5",)):
    return {"scenario": scenario, "seed": seed, "outcome": outcome,
            "exit_code": 0 if outcome != "violated" else 1, "slowdown": slowdown,
            "longest_recovery_s": recovery, "patterns": ["single"],
            "schedule": list(schedule), "violations": list(violations)}


def test_a_campaign_counts_outcomes_and_keeps_each_violation_with_its_schedule():
    results = [result("ps-sync", 0, "finished", 1.2, 3.5),
               result("ps-sync", 1, "stopped-then-resumed", 2.0),
               result("ddp-live", 2, "violated", 9.0, 1.0, ["samples lost"],
                      ("kill:rank=0:step=3", "at 2.0s: kill rank 1 (from outside)"))]
    references = {"ps-sync": Reference([0.95], 12.0, None), "ddp-live": Reference([0.9], 8, None)}
    summary = summarize(results, references)
    assert (summary["schedules_run"], summary["finished"], summary["stopped_with_reason"],
            summary["invariant_violations"]) == (3, 1, 1, 1)
    assert summary["slowdown"] == {"median": 1.6, "max": 2.0}  # the runs that exited 0
    assert summary["longest_recovery_s"] == 3.5
    assert summary["faults"] == {"kill": 3, "kill from outside": 1}
    assert summary["by_scenario"] == {"ps-sync": {"finished": 1, "stopped-then-resumed": 1},
                                      "ddp-live": {"violated": 1}}
    (violation,) = summary["violations"]
    assert violation["seed"] == 2 and violation["schedule"][1].endswith("(from outside)")
    assert summary["references"]["ps-sync"] == {"accuracies": [0.95], "wall_s": 12.0}
