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

from disttrain.strategies.ddp.live.forming import CONNECT_S
from disttrain.strategies.ddp.live.group import Beats, LiveGroup, connect, mark_dead
from disttrain.strategies.ddp.live.membership import Patience
from disttrain.strategies.ddp.live.rank import is_lost_peer

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
    context = mp.get_context("forkserver")
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


# A member that dies between publishing its address and connecting its pairs. gloo makes
# the lower address of a pair wait for the higher one to connect: the dying member's
# device is put on the highest loopback address and the survivor's on `lo`, so the survivor
# always waits (as a pair's initiator it would be refused at once). Without a bound of its
# own, that wait lasts five times the group's timeout.
DYING_HOST = "127.255.255.254"
PUBLISHED = 17  # the dying member's exit code once its address is out


class DiesOncePublished(dist.Store):
    """`inner`, whose process exits once it has published its gloo address."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)
        os._exit(PUBLISHED)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)


def dying_member(port: int) -> None:
    """Slot 1 of generation 0: arrives, publishes its address and dies."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    from disttrain.strategies.ddp.live.forming import WatchedStore, arrive

    store = WatchedStore(dist.PrefixStore("gen0/pg", connect("127.0.0.1", port, TIMEOUT_S)),
                         lambda: None, TIMEOUT_S)
    arrive(store, 1, {0: 0, 1: 0})
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=DYING_HOST)]
    options._timeout = timedelta(seconds=TIMEOUT_S)
    # Under the keys torch gives a process's first group on the CPU, as `form` makes it.
    keys = dist.PrefixStore("cpu/", dist.PrefixStore("0/", store))
    ProcessGroupGloo(DiesOncePublished(keys), 1, 2, options)
    os._exit(2)  # not reached: the store's set exits


def survivor(port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1: below the dying member's address
    group = LiveGroup(connect("127.0.0.1", port, TIMEOUT_S), 0,
                      Patience(stale_s=1.0, window_s=20.0, timeout_s=TIMEOUT_S))
    record: dict = {}
    started = time.monotonic()
    try:
        group.form(0, (0, 1))
        record["error"] = None
    except (RuntimeError, dist.DistError) as e:
        record["error"] = str(e).splitlines()[0]
        record["lost_peer"] = is_lost_peer(e)
    record["gave_up_s"] = time.monotonic() - started
    record["after"] = group.after_failure()
    group.form(*record["after"])
    record["alone"] = total()
    group.leave()
    (Path(out_dir) / "survivor.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(150)
def test_a_member_dying_between_its_address_and_its_connection_holds_the_others_seconds(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S))
    context = mp.get_context("forkserver")
    dying = context.Process(target=dying_member, args=(store.port,))
    alive = context.Process(target=survivor, args=(store.port, str(tmp_path)))
    dying.start()
    alive.start()
    dying.join(timeout=120)
    assert dying.exitcode == PUBLISHED  # it published its address, then died
    mark_dead(store, 1)  # as the launcher does once it sees the exit
    alive.join(timeout=120)
    assert alive.exitcode == 0

    record = json.loads((tmp_path / "survivor.json").read_text())
    # Inside gloo's connection of the pair, not a store wait (which the mark cuts short).
    assert record["error"] is not None and "connectFullMesh" in record["error"], record
    assert record["lost_peer"], record
    # gloo's bound of a pair's connection, five times the group's timeout while it forms:
    # 5 x CONNECT_S, not 5 x TIMEOUT_S (300 s).
    assert record["gave_up_s"] < 5 * CONNECT_S + 10.0, record
    assert record["after"] == [1, [0]] and record["alone"] == 1
