"""`disttrain chaos --quick`, as `make test` runs it: three generated schedules over real
parameter-server and live-DDP runs (from seed 0: shard 0 killed twice before its next
checkpoint; rank 0 of a live group killed twice before its next checkpoint; SIGKILLs of
workers and servers from outside every few seconds), each checked against the invariants
read from its ledgers and checkpoints, and the campaign's JSON."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_schedules_keep_every_invariant_and_say_what_they_ran(tmp_path, cli):
    output = tmp_path / "chaos.json"
    result = cli("chaos", "--quick", "--schedules", "3", "--seed", "0", "--work-dir", tmp_path / "runs",
                 "--output", output, timeout=880)
    campaign = json.loads(output.read_text())
    assert result.returncode == 0, (result.stdout[-3000:], campaign.get("violations"))
    assert campaign["schedules_run"] == 3 and campaign["invariant_violations"] == 0
    assert campaign["finished"] + campaign["stopped_with_reason"] == 3
    scenarios = [r["scenario"] for r in campaign["results"]]
    assert scenarios == ["ps-sync", "ddp-live", "ps-sync"]
    first, live, hostile = campaign["results"]
    # what was drawn is printed and saved with every result, so each reproduces from its seed
    assert first["schedule"] == ["kill:server=0:step=133", "kill:server=0:step=142:attempt=1"]
    assert live["schedule"] == ["kill:rank=0:step=144", "kill:rank=0:step=147:attempt=1"]
    assert hostile["patterns"] == ["hostile"]
    # each kill from outside that came due is recorded as sent, or skipped with why (the
    # target was between restarts, or had ended): how many come due before the run ends
    # depends on the machine's speed
    drawn = [line for line in hostile["schedule"] if line.endswith("(from outside)")]
    assert drawn and len(hostile["timed_faults_sent"]) <= len(drawn)
    for line, sent in zip(drawn, hostile["timed_faults_sent"], strict=False):
        assert sent.startswith(line)
        assert ": sent to pid " in sent or ": skipped, " in sent
    for line in first["schedule"]:
        assert line in result.stdout
    # the restarts these faults caused were seen by the run itself
    assert first["num_failures"] >= 2 and campaign["longest_recovery_s"] > 0
    # runs that kept every invariant leave nothing behind; the references stay for later schedules
    assert not (tmp_path / "runs" / "ps-sync").exists() or not any((tmp_path / "runs" / "ps-sync").iterdir())
