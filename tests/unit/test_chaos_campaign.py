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


def test_preemptions_are_counted_apart_from_the_kills_from_outside():
    preempted = result("ps-sync", 3, "finished", schedule=(
        "at 2.0s: kill worker 1 (from outside)",
        "preempt at step 40: SIGTERM to the launcher, resumed on 4 workers (from outside)",
        "preempt at step 90: SIGTERM to worker 2, resumed on 4 workers (from outside)"))
    preempted["preemptions_sent"] = ["preempt at step 40: SIGTERM to the launcher (pid 7) at step 42",
                                     "preempt at step 90: SIGTERM to worker 2 (pid 9) at step 93"]
    preempted["launches"] = [{"workers": 2, "exit_code": 143, "preempted": "..."},
                             {"workers": 4, "exit_code": 0, "preempted": "..."}]
    summary = summarize([preempted, result("ps-sync", 4, "finished")], {})
    assert summary["faults"] == {"kill": 1, "kill from outside": 1, "preemption": 2}
    assert summary["preemptions"] == {"drawn": 2, "sent": 2, "launches_stopped": 1, "ended_within_grace": 1,
                                      "runs_resized": 1}


def test_an_elastic_runs_changes_of_size_are_counted_as_grows_and_leaves_not_kills():
    elastic = result("ps-elastic", 4, "finished", schedule=(
        "resize at step 70: SIGUSR1 to the launcher (grow), 2 to 3 workers (from outside)",
        "resize at step 151: SIGTERM to worker 1 (planned leave), 3 to 2 workers (from outside)"))
    elastic["sizes"] = [2, 3, 2]
    elastic["launches"] = [{"workers": 2, "exit_code": 0, "preempted": None, "resized_to": [3, 2]}]
    summary = summarize([elastic], {})
    assert summary["faults"] == {"kill from outside": 0, "grow": 1, "planned leave": 1}
    assert summary["preemptions"]["drawn"] == 0 and summary["preemptions"]["runs_resized"] == 1
