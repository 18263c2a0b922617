"""A member that dies while a live generation forms: four ranks form generation 0; slot 3
dies, slots 0, 1 and 2 settle on generation 1; slot 2 dies before joining its rendezvous.
The test process plays the launcher, marking each death in the store as it sees the exit;
slots 0 and 1, waiting in generation 1's rendezvous, give up at once and form generation
2 together, in seconds rather than the group timeout."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.strategies.ddp.live.group import Beats, LiveGroup, connect, mark_dead
from disttrain.strategies.ddp.live.membership import Patience

pytestmark = pytest.mark.slow  # every test spawns a process group of live ranks

TIMEOUT_S = 60.0  # what a member would wait without the launcher's mark


def total() -> int:
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return int(ones.item())


def member(slot: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = LiveGroup(connect("127.0.0.1", port, TIMEOUT_S), slot,
                      Patience(stale_s=1.0, window_s=20.0, timeout_s=TIMEOUT_S))
    beats = Beats(connect("127.0.0.1", port, TIMEOUT_S), slot, interval_s=0.1)
    group.form(0, (0, 1, 2, 3))
    beats.start()
    record: dict = {"gen0": total()}
    if slot == 3:
        os._exit(1)  # dies between two collectives
    try:
        total()
    except (RuntimeError, dist.DistError):
        pass
    record["next"] = group.after_failure()
    if slot == 2:
        os._exit(1)  # dies with generation 1's member list fixed, before its rendezvous
    started = time.monotonic()
    try:
        group.form(*record["next"])
        record["error"] = None
    except (RuntimeError, dist.DistError) as e:
        record["error"] = str(e).splitlines()[0]
    record["gave_up_s"] = time.monotonic() - started
    record["after"] = group.after_failure()
    group.form(*record["after"])
    record["gen2"] = total()
    record["reformed_s"] = time.monotonic() - started
    group.leave()
    beats.stop()
    (Path(out_dir) / f"slot{slot}.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(150)
def test_survivor_stops_waiting_for_a_member_that_died_while_the_group_formed(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S))
    context = mp.get_context("spawn")
    processes = [context.Process(target=member, args=(slot, store.port, str(tmp_path))) for slot in range(4)]
    for process in processes:
        process.start()
    for slot in (3, 2):  # the launcher marks each death as it sees the exit
        processes[slot].join(timeout=120)
        assert processes[slot].exitcode == 1
        mark_dead(store, slot)
    for slot in (0, 1):
        processes[slot].join(timeout=120)
        assert processes[slot].exitcode == 0

    for slot in (0, 1):
        record = json.loads((tmp_path / f"slot{slot}.json").read_text())
        assert record["gen0"] == 4 and record["next"] == [1, [0, 1, 2]]
        assert record["error"] is not None and "slot 2 died while generation 1 formed" in record["error"]
        assert record["after"] == [2, [0, 1]] and record["gen2"] == 2
        assert record["gave_up_s"] < 10.0 and record["reformed_s"] < 10.0  # far below TIMEOUT_S
