"""The figures of docs/chaos.md are those of the committed campaign and reruns
(benchmarks/results/chaos/), as tools/chaos_figures.py writes them; another campaign's
JSON gives other figures, and a violation is shown with its schedule and its rerun."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain.chaos.campaign import summarize
from disttrain.chaos.runner import Reference

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def chaos_figures(tool):
    return tool("chaos_figures")


def result(scenario, seed, outcome, slowdown=1.5, recovery=None, violations=()):
    return {"scenario": scenario, "seed": seed, "outcome": outcome,
            "exit_code": 0 if outcome == "finished" else 1, "slowdown": slowdown,
            "longest_recovery_s": recovery, "patterns": ["single"],
            "schedule": [f"kill:worker=1:step={seed + 5}"], "violations": list(violations)}


def campaign(results):
    references = {"ps-sync": Reference([0.95], 12.0, None), "ddp-live": Reference([0.9, 0.92], 8.5, None)}
    summary = summarize(results, references)
    summary["first_seed"], summary["wall_s"] = 0, 600.0
    return summary


def test_the_page_holds_the_committed_campaigns_figures(chaos_figures):
    page = (REPO_ROOT / "docs" / "chaos.md").read_text()
    block = page.split(chaos_figures.BEGIN, 1)[1].split(chaos_figures.END, 1)[0]
    assert block == chaos_figures.render(*chaos_figures.committed()), "run: python tools/chaos_figures.py"


def test_the_figures_are_the_campaigns(chaos_figures):
    text = chaos_figures.render(campaign([result("ps-sync", 0, "finished", 1.25, 3.5),
                                          result("ddp-live", 1, "finished", 2.5)]))
    prose = " ".join(text.split())
    assert "`disttrain chaos --schedules 2 --seed 0`, 10 minutes" in prose
    assert "median 1.88x, max 2.50x" in prose and "3.5 s." in prose
    assert "Faults: kill 2." in prose  # none from outside: not named
    assert "| 2 | 2 | 0 | 0 |" in text
    assert "| `ps-sync` | 1 | 0 | 0 | 95.00% | 12.0 s |" in text
    assert "| `ddp-live` | 1 | 0 | 0 | 90.00-92.00% | 8.5 s |" in text
    assert "Violations found" not in text


def test_a_violation_is_shown_with_its_schedule_and_what_its_rerun_did(chaos_figures):
    found = campaign([result("ps-sync", 7, "violated", violations=["shard 1: 16 samples lost"]),
                      result("ddp-live", 8, "violated", violations=["hung"])])
    rerun = campaign([result("ps-sync", 7, "finished")])
    text = chaos_figures.render(found, [rerun])
    assert "| `ps-sync` | 7 | `kill:worker=1:step=12` | shard 1: 16 samples lost | finished |" in text
    assert "| `ddp-live` | 8 | `kill:worker=1:step=13` | hung | not run again |" in text
