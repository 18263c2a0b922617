"""A drawn schedule of an elastic run, end to end: `disttrain chaos --scenarios ps-elastic
--seed 4` starts `disttrain ps --workers 2:4` as a user does and, from outside, once the
run reaches each drawn step on the size before it, sends SIGUSR1 to its launcher at step
70 (a grow, 2 to 3 workers), again at step 114 (3 to 4), and SIGTERM to worker 1 at step
151 (a planned leave, 4 to 3). The run changes size by itself each time, in its one
launch, and ends exit 0; the invariants hold over the whole run: every sample of every
epoch applied once by every shard's ledger, every worker of the last size done, every
shard at the run's last step, the accuracy within a point of the fault-free run's. And the
same for a live DDP group that ranks join, leave and die in while it runs (`ddp-elastic`)."""

from __future__ import annotations

import json

import pytest

SEED, SIZES = 4, [2, 3, 4, 3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_drawn_schedule_of_grows_and_a_planned_leave_keeps_every_invariant(tmp_path, cli):
    output = tmp_path / "chaos.json"
    result = cli("chaos", "--scenarios", "ps-elastic", "--seed", SEED, "--schedules", 1,
                 "--work-dir", tmp_path / "work", "--output", output, timeout=580)
    campaign = json.loads(output.read_text())
    assert result.returncode == 0, (result.stdout[-3000:], campaign.get("violations"))
    (run,) = campaign["results"]
    assert run["patterns"] == ["elastic"] and run["violations"] == [] and run["outcome"] == "finished"
    assert run["sizes"] == SIZES, run
    (launch,) = run["launches"]  # the run changed size by itself: no --resume
    assert launch["exit_code"] == 0 and launch["resized_to"] == SIZES[1:]
    assert [line.split(" (pid")[0] for line in run["resizes_sent"]] == [
        "resize at step 70: SIGUSR1 to the launcher", "resize at step 114: SIGUSR1 to the launcher",
        "resize at step 151: SIGTERM to worker 1"]
    for line in run["schedule"]:
        assert line in result.stdout  # printed, so the schedule reproduces from its seed


LIVE_SEED, LIVE_SIZES = 3, [2, 3, 2, 3, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_drawn_schedule_of_arrivals_a_kill_and_a_planned_leave_of_a_live_group_keeps_every_invariant(
        tmp_path, cli):
    """`disttrain chaos --scenarios ddp-elastic --seed 3` starts `disttrain ddp --ddp-recovery
    live --world-size 2:4` and, from outside, at drawn steps: an arrival (a second `disttrain
    ddp ... --join` launcher, slot 2; the group held until it asks to join), a SIGKILL to that
    arrival's rank (the others re-form, held until its launcher's new process asks to join
    again), a SIGTERM to the arrival's launcher (its rank leaves at a step boundary), and a
    second arrival (slot 3). The group goes through every size sent, in its one launch,
    every launcher ends exit 0, and every global batch of every epoch is applied once.
    (This seed first broke the check of survivors, not the run: read from the registry, the
    leader held past the heartbeat timeout counted as restarted, though its process was
    the same; the launcher's `rank_pids` are read instead.)"""
    output = tmp_path / "chaos.json"
    result = cli("chaos", "--scenarios", "ddp-elastic", "--seed", LIVE_SEED, "--schedules", 1,
                 "--work-dir", tmp_path / "work", "--output", output, timeout=580)
    campaign = json.loads(output.read_text())
    assert result.returncode == 0, (result.stdout[-3000:], campaign.get("violations"))
    (run,) = campaign["results"]
    assert run["patterns"] == ["elastic"] and run["violations"] == [] and run["outcome"] == "finished"
    assert run["sizes"] == LIVE_SIZES, run  # the summary's live_world_sizes
    (launch,) = run["launches"]
    assert launch["exit_code"] == 0
    assert run["arrival_exit_codes"] == {"2": 0, "3": 0}
    assert [line.split(" (pid")[0] for line in run["resizes_sent"]] == [
        "resize at step 72: arrival started", "resize at step 101: SIGKILL to rank 2",
        "resize at step 126: SIGTERM to the launcher of slot 2", "resize at step 151: arrival started"]
    assert campaign["faults"] == {"grow": 2, "planned leave": 1, "kill from outside": 1}
    for line in run["schedule"]:
        assert line in result.stdout  # printed, so the schedule reproduces from its seed
