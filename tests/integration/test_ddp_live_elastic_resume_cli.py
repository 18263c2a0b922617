"""A live run's checkpoint resumed on another size, as a user drives it: a live run of 2
ranks, every rank SIGTERMed mid-run (it checkpoints that step and exits 143), is resumed
by `disttrain ddp --ddp-recovery live --world-size M --resume` on 3 ranks, on 1, and as
an elastic run of 3:4. The
run's global batch (2 x the batch size) is kept, each size splitting it over its ranks
(32 over 3: 11, 11, 10), so the epoch's remaining global batches are trained once by the
M ranks: the ledger shows every global batch of every epoch applied exactly once over
both launches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from disttrain.metrics.logger import METRICS_FILE
from tests import live_runs
from tests.live_runs import WAIT_S, rank_pid, start, wait_for

BATCH, EPOCHS, FIRST = 16, 6, 2
ARGS = ["--ddp-recovery", "live", "--dataset", "digits",
        "--num-epochs", EPOCHS, "--batch-size", BATCH, "--seed", 1, "--timeout-s", 120,
        "--num-threads", 1, "--max-restarts", 2,
        "--set", "training.model_architecture=mlp", "--set", "training.learning_rate=0.003",
        "--set", "coordinator.heartbeat_interval=0.2", "--set", "coordinator.heartbeat_timeout=2"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> tuple[Path, int]:
    """A live run of 2 whose ranks were all SIGTERMed mid-run: its checkpoint folder and
    the step it stopped at."""
    folder = tmp_path_factory.mktemp("stopped")
    logs, output = folder / "logs", folder / "first.out"
    first = start([*ARGS, "--world-size", FIRST, "--log-dir", logs, "--checkpoint-dir", folder / "ckpt",
                   "--set", "training.log_interval=2"], output)
    try:
        wait_for(logs / "rank0" / METRICS_FILE, '"step": 4,', first)
        ranks = [rank_pid(first, slot) for slot in range(FIRST)]
        os.kill(ranks[0], signal.SIGSTOP)  # both SIGTERMed mid-run, whatever the machine's speed
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        os.kill(ranks[0], signal.SIGCONT)
        assert first.wait(timeout=WAIT_S) == 143, output.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    stopped = re.search(r"every member left the group at step (\d+)",
                        "".join((logs / f"rank{slot}.log").read_text() for slot in range(FIRST)))
    assert stopped and int(stopped.group(1)) >= 4, "no rank wrote the checkpoint of a step mid-run"
    return folder / "ckpt", int(stopped.group(1))


@pytest.mark.slow
@pytest.mark.timeout(600)
# 3 ranks: the elastic 3:4 starts 3
@pytest.mark.parametrize("world_size", [pytest.param("3", marks=pytest.mark.extended), "1", "3:4"])
def test_a_stopped_live_run_resumes_on_another_size_and_trains_every_global_batch_once(cli, stopped_run,
                                                                                       tmp_path, world_size):
    """Resumed on 3, on 1, and as an elastic run of 3:4 (it starts 3)."""
    checkpoints, step = stopped_run
    size = int(world_size.split(":")[0])
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints, folder)  # each size resumes the same stopped run
    logs = tmp_path / "logs"
    resumed = cli("ddp", *ARGS, "--world-size", world_size, "--log-dir", logs, "--checkpoint-dir", folder,
                  "--resume", timeout=WAIT_S * 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["samples_applied"] == EPOCHS * live_runs.samples_per_epoch(BATCH * FIRST)
    assert (summary["samples_lost"], summary["samples_applied_twice"]) == (0, 0)
    assert summary["steps"] * BATCH * FIRST == summary["samples_applied"]  # the global batch kept
    assert f"from step {step} " in (logs / "rank0.log").read_text()
    # The first launch's sizes, then this one's. A rank SIGTERMed while it already waited in
    # a step boundary's collective (its peer stopped there) said it stays at that boundary:
    # it leaves at the next one, after a generation without the rank that left (found at
    # 2 1 3 on a loaded machine); every global batch is still trained once (checked above).
    sizes = summary["live_world_sizes"]
    assert sizes[0] == FIRST and sizes[-1] == size and all(s < FIRST for s in sizes[1:-1]), sizes
    assert summary["live_recoveries"][-1]["kind"] == "resume"
    assert summary["live_recoveries"][-1]["members"] == list(range(size))
    # The M ranks trained the rest: each rank's share of the global batches after the stop.
    metrics = (logs / f"rank{size - 1}" / METRICS_FILE).read_text().splitlines()
    trained = [json.loads(line) for line in metrics]
    assert any(record.get("step", 0) > step for record in trained)
