"""An elastic live DDP run as a user drives it: `disttrain ddp --ddp-recovery live
--world-size 2:3` starts 2 ranks; a second `disttrain ddp ... --join --rdzv-endpoint` (the
store address the first launcher logged) adds a third, which joins at a step boundary
with a live peer's state; then rank 1 is SIGTERMed and leaves at a step boundary, not
restarted though restarts are allowed. A fourth rank, while the run is at its maximum, is
refused before anything starts; once rank 1 has left, another arrival takes the free
place and leaves again when its launcher is SIGTERMed. The summary says the sizes the run
trained at (2, 3, 2, 3, 2), and the ledger shows every global batch of every epoch applied exactly once.

Pacing without sleeps: the test holds the group (SIGSTOP to rank 0) until the arrival has
taken its join ticket, so the join cannot come after the run's end however slowly the
arrival starts; every other wait is on a log line, with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from disttrain.metrics.logger import METRICS_FILE
from tests import live_runs
from tests.live_runs import WAIT_S, rank_pid, start, wait_for

MIN, MAX, BATCH, EPOCHS = 2, 3, 16, 6
ARGS = ["--ddp-recovery", "live", "--world-size", f"{MIN}:{MAX}", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 120,
        "--num-threads", 1, "--max-restarts", 2,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=2"]
JOIN_LINE = re.compile(r"--join --rdzv-endpoint (\S+)`")


def samples_per_epoch() -> int:
    """The samples of an epoch's whole global batches (the global batch is MIN's)."""
    return live_runs.samples_per_epoch(BATCH * MIN)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_live_run_grows_with_a_rank_started_by_hand_and_shrinks_when_one_is_sigtermed(cli, tmp_path):
    host_logs, arrival_logs = tmp_path / "logs", tmp_path / "arrival-logs"
    host_out, arrival_out = tmp_path / "host.out", tmp_path / "arrival.out"
    shared = ["--checkpoint-dir", tmp_path / "ckpt"]
    host = start([*ARGS, *shared, "--log-dir", host_logs], host_out)
    second_logs, second_out = tmp_path / "second-logs", tmp_path / "second.out"
    arrival = second = None
    try:
        endpoint = wait_for(host_out, JOIN_LINE, host).group(1)
        wait_for(host_logs / "rank0.log", "generation 0 trains from step 0", host)
        leader = rank_pid(host, 0)
        os.kill(leader, signal.SIGSTOP)  # the group waits in its next all-reduce
        try:
            joining = ["--join", "--rdzv-endpoint", endpoint]
            arrival = start([*ARGS, *shared, "--log-dir", arrival_logs, *joining], arrival_out)
            wait_for(arrival_out, "joining the run at .* as slot 2", arrival, host)
            wait_for(arrival_logs / "rank2.log", r"slot 2 asks to join the running group \(ticket 1\)",
                     arrival)
        finally:
            os.kill(leader, signal.SIGCONT)
        grown = wait_for(host_logs / "rank0.log", r"world size 2 -> 3 ranks \(slot 2 joined\): the global "
                         r"batch of 32 split (\S+)", host, arrival)
        assert grown.group(1) == "11,11,10"

        # A fourth rank finds the run at its maximum: refused in one line, nothing started
        # (the group held meanwhile, so it is still at 3).
        os.kill(leader, signal.SIGSTOP)
        try:
            refused = cli("ddp", *ARGS, *shared, "--log-dir", tmp_path / "refused-logs", *joining,
                              timeout=WAIT_S)
        finally:
            os.kill(leader, signal.SIGCONT)
        assert refused.returncode == 1, refused.stderr[-3000:]
        assert refused.stderr.strip().splitlines()[-1] == (
            f"error: the run at {endpoint} has its maximum of 3 ranks (--world-size MIN:MAX) and no spares "
            "(ddp.spares); start this one when a rank has left")
        assert not list((tmp_path / "refused-logs").glob("rank*.log"))

        leaver = rank_pid(host, 1)
        os.kill(leaver, signal.SIGTERM)
        shrunk = wait_for(host_logs / "rank0.log", r"world size 3 -> 2 ranks \(slot 1 left\): the global "
                          r"batch of 32 split (\S+)", host, arrival)
        assert shrunk.group(1) == "16,16"

        # The place is free again: another arrival takes it (slot 3); a SIGTERM to its
        # launcher (a scheduler taking that machine back) makes its rank leave, and that
        # launcher ends well. The group is held while each signal goes out.
        os.kill(leader, signal.SIGSTOP)
        try:
            second = start([*ARGS, *shared, "--log-dir", second_logs, *joining], second_out)
            wait_for(second_logs / "rank3.log", r"slot 3 asks to join the running group \(ticket 2\)",
                     second)
        finally:
            os.kill(leader, signal.SIGCONT)
        wait_for(host_logs / "rank0.log", r"world size 2 -> 3 ranks \(slot 3 joined\)", host, arrival, second)
        os.kill(leader, signal.SIGSTOP)
        try:
            second.send_signal(signal.SIGTERM)
        finally:
            os.kill(leader, signal.SIGCONT)
        wait_for(host_logs / "rank0.log", r"world size 3 -> 2 ranks \(slot 3 left\)", host, arrival)
        assert second.wait(timeout=WAIT_S) == 0, second_out.read_text()[-3000:]
        assert "rank 3 left the run (SIGTERM); it is not started again" in second_out.read_text()

        assert host.wait(timeout=WAIT_S) == 0, host_out.read_text()[-3000:]
        assert arrival.wait(timeout=WAIT_S) == 0, arrival_out.read_text()[-3000:]
    finally:
        for process in (host, arrival, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    summary = json.loads((host_logs / "summary.json").read_text())
    assert summary["live_world_sizes"] == [2, 3, 2, 3, 2]
    assert (summary["min_world_size"], summary["max_world_size"]) == (MIN, MAX)
    assert [r["kind"] for r in summary["live_recoveries"]] == ["grow", "leave", "grow", "leave"]
    assert [r["members"] for r in summary["live_recoveries"]] == [[0, 1, 2], [0, 2], [0, 2, 3], [0, 2]]
    # The leaver was not started again (restarts were allowed): one process, and it is
    # not among the last group's.
    assert summary["rank_pids"]["1"] == [leaver] and set(summary["final_pids"]) == {"0", "2"}
    assert summary["final_pids"]["0"] == leader and summary["rank_pids"]["0"] == [leader]
    assert "left the group at step" in (host_logs / "rank1.log").read_text()
    assert "rank 1 left the run (SIGTERM); it is not started again" in host_out.read_text()
    # Every global batch of every epoch applied exactly once, across the three sizes.
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] * BATCH * MIN == summary["samples_applied"]
    assert summary["final_accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_when_every_rank_is_sigtermed_the_run_stops_at_a_checkpoint_and_resume_finishes_it(cli, tmp_path):
    """Every rank leaves (a scheduler preempting the whole run through its ranks): the last
    to leave is alone in its group and, its leader, writes a checkpoint of that step; the
    launcher exits 143 with one line naming the folder; `--resume` trains the rest, and the
    ledger shows every global batch of every epoch applied exactly once over both runs."""
    logs, output = tmp_path / "logs", tmp_path / "first.out"
    folders = ["--log-dir", logs, "--checkpoint-dir", tmp_path / "ckpt"]
    first = start([*ARGS, *folders, "--set", "training.log_interval=2"], output)
    try:
        # A few steps in (rank 0's metrics record of step 4), wherever that is in time.
        wait_for(logs / "rank0" / METRICS_FILE, '"step": 4,', first)
        ranks = [rank_pid(first, slot) for slot in (0, 1)]
        os.kill(ranks[0], signal.SIGSTOP)  # both SIGTERMed mid-run, whatever the machine's speed
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        os.kill(ranks[0], signal.SIGCONT)
        assert first.wait(timeout=WAIT_S) == 143, output.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    last_line = output.read_text().strip().splitlines()[-1]
    expected = f"left (SIGTERM) before the run ended; `--resume` goes on from the newest checkpoint in " \
               f"{tmp_path / 'ckpt'}"
    assert last_line.startswith("error: rank(s) ") and expected in last_line, last_line
    assert not (logs / "summary.json").exists()
    stopped = re.search(r"every member left the group at step (\d+)", (logs / "rank0.log").read_text()
                        + (logs / "rank1.log").read_text())
    assert stopped and int(stopped.group(1)) >= 4, "no rank wrote the checkpoint of a step mid-run"

    resumed = cli("ddp", *ARGS, *folders, "--resume", timeout=WAIT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] * BATCH * MIN == summary["samples_applied"]
    assert f"from step {stopped.group(1)} " in (logs / "rank0.log").read_text()
    assert summary["live_world_sizes"][0] == 2 and summary["live_world_sizes"][-1] == 2  # resumed on 2
    assert summary["live_recoveries"][-1]["kind"] == "resume"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended  # arrivals and leaves: the two tests above
def test_below_its_minimum_a_run_trains_nothing_until_a_rank_joins(tmp_path):
    """Rank 1 of a 2:3 run leaves: the one left is below MIN, so it waits at the step
    boundary, training nothing, until a rank started by hand joins; the run then ends
    with every global batch of every epoch applied once."""
    logs, output = tmp_path / "logs", tmp_path / "host.out"
    arrival_logs, arrival_out = tmp_path / "arrival-logs", tmp_path / "arrival.out"
    shared = ["--checkpoint-dir", tmp_path / "ckpt"]
    host = start([*ARGS, *shared, "--log-dir", logs, "--set", "training.log_interval=2"], output)
    arrival = None
    try:
        endpoint = wait_for(output, JOIN_LINE, host).group(1)
        wait_for(logs / "rank0" / METRICS_FILE, '"step": 4,', host)
        os.kill(rank_pid(host, 1), signal.SIGTERM)
        wait_for(logs / "rank0.log", "has 1 rank.s., below the run's minimum of 2: it waits", host)
        arrival = start([*ARGS, *shared, "--log-dir", arrival_logs, "--join", "--rdzv-endpoint", endpoint],
                        arrival_out)
        wait_for(logs / "rank0.log", r"world size 1 -> 2 ranks \(slot 2 joined\)", host, arrival)
        assert host.wait(timeout=WAIT_S) == 0, output.read_text()[-3000:]
        assert arrival.wait(timeout=WAIT_S) == 0, arrival_out.read_text()[-3000:]
    finally:
        for process in (host, arrival):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["live_world_sizes"] == [2, 1, 2]
    leave, grow = summary["live_recoveries"]
    assert (leave["kind"], leave["members"], grow["kind"], grow["members"]) == ("leave", [0], "grow", [0, 2])
    assert leave["step"] == grow["step"]  # nothing trained by the one rank left
    assert summary["samples_applied"] == EPOCHS * samples_per_epoch()
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
