"""Hot spares of a live DDP run, as a user drives it: `disttrain ddp --ddp-recovery live
--world-size 2 --spares 1` starts 2 ranks and a spare (slot 2) that starts up and waits
outside the group. Rank 1 is SIGKILLed mid-run: the survivor re-forms alone and the spare
steps in at the next step boundary with its state (the group back at 2 without waiting
for a restart), while rank 1's process, started again, waits as the new spare. Then rank
0 is SIGTERMed: it leaves at a step boundary and that new spare steps in for it. The
summary lists the spares and both step-ins, the log says each in one line, and the ledger
shows every global batch of every epoch applied exactly once.

Pacing without sleeps: each signal goes out once the line it waits for is in a log, and
the group is held (SIGSTOP to a member) until the spare has asked to join, so the run
cannot end first however slowly a process starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from disttrain.metrics.logger import METRICS_FILE
from tests.live_runs import POLL_S, WAIT_S, rank_pid, samples_per_epoch, start, stop, wait_for

SIZE, BATCH, EPOCHS = 2, 16, 6
ARGS = ["--ddp-recovery", "live", "--world-size", SIZE, "--spares", 1, "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 120,
        "--num-threads", 1, "--max-restarts", 2,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "training.log_interval=2",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=2"]
@contextmanager
def held(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) meanwhile: its group waits for it in a collective."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


STEPPED_IN = r"spare slot {} stepped in at step (\d+) \(generation (\d+), members {}\)"


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_spare_steps_in_for_a_killed_rank_and_the_restarted_one_for_a_leaver(tmp_path):
    logs, output = tmp_path / "logs", tmp_path / "run.out"
    run = start([*ARGS, "--log-dir", logs, "--checkpoint-dir", tmp_path / "ckpt"], output)
    try:
        wait_for(output, r"and 1 hot spare\(s\) \(slot\(s\) 2\)", run)
        wait_for(logs / "rank2.log", "slot 2 waits as a spare: every place of the run is held", run)
        wait_for(logs / "rank0" / METRICS_FILE, '"step": 4,', run)
        leader, killed, spare = (rank_pid(run, slot) for slot in (0, 1, 2))
        with held(leader):  # the spare asks to join before the survivor trains on alone
            os.kill(killed, signal.SIGKILL)
            wait_for(logs / "rank2.log", r"slot 2 asks to join the running group", run)
        first = wait_for(logs / "rank0.log", STEPPED_IN.format(2, "0,2"), run)

        # Slot 1's process, started again, holds no place now: it waits as the new spare.
        with held(leader):
            wait_for(logs / "rank1.log", "slot 1 waits as a spare", run)
            os.kill(leader, signal.SIGTERM)  # a planned leave at the next step boundary
        wait_for(logs / "rank0.log", "slot 0 leaves the group at step", run)
        with held(spare):  # the one left waits while slot 1 steps in for the leaver
            wait_for(logs / "rank1.log", r"slot 1 asks to join the running group", run)
        second = wait_for(logs / "rank1.log", STEPPED_IN.format(1, "1,2"), run)
        assert run.wait(timeout=WAIT_S) == 0, output.read_text()[-3000:]
    finally:
        stop(run)

    summary = json.loads((logs / "summary.json").read_text())
    out = output.read_text()
    assert "rank 0 left the run (SIGTERM); it is not started again" in out
    # The spare never restarted: one process, in the last group with slot 1's second one.
    assert summary["rank_pids"]["2"] == [spare] and summary["final_pids"]["2"] == spare
    assert summary["rank_pids"]["0"] == [leader] and len(summary["rank_pids"]["1"]) == 2
    assert killed not in summary["final_pids"].values() and set(summary["final_pids"]) == {"1", "2"}
    assert (summary["num_spares"], summary["num_spares_started"]) == (1, 2)
    step_ins = summary["spare_step_ins"]
    assert [(s["slot"], s["step"], s["generation"]) for s in step_ins] == [
        (2, int(first.group(1)), int(first.group(2))), (1, int(second.group(1)), int(second.group(2)))]
    assert all(s["after_loss_s"] is not None and s["after_loss_s"] >= 0 for s in step_ins)
    # The group went 2 -> 1 (the kill) -> 2 (spare 2) -> 1 (the leave) -> 2 (spare 1).
    assert summary["live_world_sizes"] == [2, 1, 2, 1, 2]
    assert [r["kind"] for r in summary["live_recoveries"]] == ["shrink", "grow", "leave", "grow"]
    assert [r.get("spares", []) for r in summary["live_recoveries"]] == [[], [2], [], [1]]
    # Each step-in logged in one line, by the leader of the group it stepped into.
    log = "".join((logs / f"rank{slot}.log").read_text() for slot in range(3))
    assert len(re.findall(r"spare slot \d stepped in at step", log)) == 2
    # Every global batch of every epoch applied exactly once, through both changes.
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch(BATCH * SIZE)
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] * BATCH * SIZE == summary["samples_applied"]
    assert summary["final_accuracy"] > 0.8


def wait_for_either(paths: list[Path], pattern: str, *processes: subprocess.Popen) -> Path:
    """The first of `paths` whose file holds `pattern` (deadline as `wait_for`'s)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for path in paths:
            if path.exists() and re.search(pattern, path.read_text(errors="replace")):
                return path
        ended = [p for p in processes if p.poll() is not None]
        assert not ended, f"{ended[0].args} ended ({ended[0].returncode}) before {pattern!r}"
        time.sleep(POLL_S)
    pytest.fail(f"no {pattern!r} in any of {paths} within {WAIT_S:.0f}s")


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_an_elastic_runs_spare_does_not_grow_it_and_an_arrival_at_its_maximum_waits_as_one(tmp_path):
    """`--world-size 2:3 --spares 1`: the spare waits though a place is open (growing is the
    scheduler's call); an arrival takes that place (3 ranks); a second arrival, at the
    maximum, waits as a spare instead of being refused; rank 1 SIGTERMed, one of the two
    spares steps in (back at 3), the other exits 0 at the end with its launcher."""
    args = [*ARGS[:2], "--world-size", "2:3", *ARGS[4:]]
    logs, output = tmp_path / "logs", tmp_path / "run.out"
    shared = ["--checkpoint-dir", tmp_path / "ckpt"]
    run = start([*args, *shared, "--log-dir", logs], output)
    arrivals: list[subprocess.Popen] = []
    try:
        endpoint = wait_for(output, r"--join --rdzv-endpoint (\S+)`", run).group(1)
        wait_for(logs / "rank2.log", "slot 2 waits as a spare: every place of the run is held", run)
        wait_for(logs / "rank0" / METRICS_FILE, '"step": 2,', run)
        leader = rank_pid(run, 0)
        joining = [*args, *shared, "--join", "--rdzv-endpoint", endpoint]
        with held(leader):  # the arrival asks to join before the run can end
            arrivals.append(start([*joining, "--log-dir", tmp_path / "first-logs"], tmp_path / "first.out"))
            wait_for(tmp_path / "first-logs" / "rank3.log", "slot 3 asks to join the running group",
                     *arrivals)
        wait_for(logs / "rank0.log", r"world size 2 -> 3 ranks \(slot 3 joined\)", run, *arrivals)
        with held(leader):  # at the maximum: the second arrival waits as a spare
            arrivals.append(start([*joining, "--log-dir", tmp_path / "second-logs"], tmp_path / "second.out"))
            wait_for(tmp_path / "second.out", "has its maximum of 3 ranks: slot 4 waits as a spare",
                     *arrivals)
            wait_for(tmp_path / "second-logs" / "rank4.log", "slot 4 waits as a spare", *arrivals)
            os.kill(rank_pid(run, 1), signal.SIGTERM)  # a planned leave at the next step boundary
        wait_for(logs / "rank1.log", "slot 1 leaves the group at step", run)
        with held(leader):  # one spare asks to join before the two left can end the run
            stepping = wait_for_either([logs / "rank2.log", tmp_path / "second-logs" / "rank4.log"],
                                       "asks to join the running group", run, *arrivals)
        slot = int(stepping.stem.removeprefix("rank"))
        wait_for(logs / "rank0.log", STEPPED_IN.format(slot, f"0,3,{slot}" if slot == 4 else "0,2,3"), run)
        assert run.wait(timeout=WAIT_S) == 0, output.read_text()[-3000:]
        for arrival in arrivals:
            assert arrival.wait(timeout=WAIT_S) == 0, arrival.args
    finally:
        stop(run, *arrivals)

    summary = json.loads((logs / "summary.json").read_text())
    assert summary["live_world_sizes"] == [2, 3, 2, 3]
    assert [r.get("spares", []) for r in summary["live_recoveries"]] == [[], [], [slot]]
    assert [s["slot"] for s in summary["spare_step_ins"]] == [slot]
    assert summary["num_spares"] == 1 and set(summary["final_pids"]) == {"0", "3", str(slot)}
    other = ({2, 4} - {slot}).pop()  # the spare that never stepped in ended with the run
    other_log = (logs if other == 2 else tmp_path / "second-logs") / f"rank{other}.log"
    assert f"slot {other}: the run ended while it waited as a spare" in other_log.read_text()
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch(BATCH * SIZE)
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
