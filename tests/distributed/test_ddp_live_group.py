"""A live group's generations with real processes and a real TCPStore: three ranks form
generation 0; one process dies; the survivors notice in their next collective, settle on
the members left (the dead one's beats go stale) and all-reduce in generation 1; a new
process of the dead rank asks to join, the survivors see its ticket at a step boundary,
grow to generation 2 with it, and hand it their state by broadcast."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.strategies.ddp.live.group import Beats, LiveGroup, connect
from disttrain.strategies.ddp.live.membership import Patience
from disttrain.strategies.ddp.live.state import share_state
from tests.live_steps import live_step

pytestmark = pytest.mark.slow  # every test spawns a process group of live ranks

TIMEOUT_S = 30.0
STALE_S = 1.0


def master_store() -> dist.TCPStore:
    """The launcher's store, on a free port."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=TIMEOUT_S))


def total(group: LiveGroup) -> int:
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return int(ones.item())


def survivor(slot: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = LiveGroup(connect("127.0.0.1", port, TIMEOUT_S), slot, Patience(STALE_S, 10.0, TIMEOUT_S))
    beats = Beats(connect("127.0.0.1", port, TIMEOUT_S), slot, interval_s=0.1)
    group.form(0, (0, 1, 2))
    beats.start()
    record: dict = {"pid": os.getpid(), "gen0": total(group)}
    if slot == 1:
        beats.stop()
        os._exit(1)  # dies between two collectives
    try:
        total(group)
        record["error"] = None
    except (RuntimeError, dist.DistError) as e:
        record["error"] = type(e).__name__
    started = time.monotonic()
    record["next"] = group.after_failure()
    record["settle_s"] = time.monotonic() - started
    group.form(*record["next"])
    record["gen1"] = total(group)
    # Step boundaries until the rejoining rank's ticket shows (each one a broadcast).
    deadline = time.monotonic() + TIMEOUT_S * 2
    tickets = 0
    while tickets == 0 and time.monotonic() < deadline:
        tickets = group.pending_joins(0)
    record["tickets"] = tickets
    record["grown"] = group.grow(0, tickets)
    group.form(*record["grown"])
    state = {"weights": torch.arange(4, dtype=torch.float32) + 40, "step": 17} if group.rank == 0 else None
    share_state(state, 0, group.rank, group.store, f"gen{group.generation}/state", TIMEOUT_S)
    record["gen2"] = total(group)
    record["pid_after"] = os.getpid()
    group.finish()
    dist.barrier()
    group.leave()
    beats.stop()
    (Path(out_dir) / f"slot{slot}.json").write_text(json.dumps(record))
    os._exit(0)


def joiner(port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = LiveGroup(connect("127.0.0.1", port, TIMEOUT_S), 1, Patience(STALE_S, 10.0, TIMEOUT_S))
    admitted = group.request_join()
    assert admitted is not None
    group.form(*admitted)
    state = share_state(None, 0, group.rank, group.store, f"gen{group.generation}/state", TIMEOUT_S)
    record = {"admitted": admitted, "rank": group.rank, "weights": state["weights"].tolist(),
              "step": state["step"], "gen2": total(group)}
    dist.barrier()
    group.leave()
    (Path(out_dir) / "joiner.json").write_text(json.dumps(record))
    os._exit(0)


@pytest.mark.timeout(180)
def test_survivors_reform_and_take_the_rank_back(tmp_path):
    store = master_store()
    context = mp.get_context("forkserver")
    first = [context.Process(target=survivor, args=(slot, store.port, str(tmp_path))) for slot in range(3)]
    for process in first:
        process.start()
    first[1].join(timeout=120)
    assert first[1].exitcode == 1  # the dead rank
    second = context.Process(target=joiner, args=(store.port, str(tmp_path)))
    second.start()
    for process in (first[0], first[2], second):
        process.join(timeout=150)
        assert process.exitcode == 0

    survivors = [json.loads((tmp_path / f"slot{slot}.json").read_text()) for slot in (0, 2)]
    for record in survivors:
        assert record["gen0"] == 3 and record["error"] is not None  # the loss surfaced as an error
        assert record["next"] == [1, [0, 2]] and record["gen1"] == 2
        assert record["settle_s"] < 10.0  # the dead rank's beats went stale before the window
        assert record["tickets"] == 1 and record["grown"] == [2, [0, 1, 2]] and record["gen2"] == 3
        assert record["pid_after"] == record["pid"]
    rejoined = json.loads((tmp_path / "joiner.json").read_text())
    assert rejoined["admitted"] == [2, [0, 1, 2]] and rejoined["rank"] == 1
    assert rejoined["weights"] == [40.0, 41.0, 42.0, 43.0] and rejoined["step"] == 17
    assert rejoined["gen2"] == 3



class LateHolder:
    """Holds a process group in a collective's callback and lets it go on gloo's worker
    thread only once the rank has dropped the group (as PowerSGD's callbacks can, when the
    main thread leaves the generation the moment the hook's future is complete)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __del__(self):
        if threading.current_thread() is threading.main_thread():
            return  # the callback ran here (its future was done when attached): nothing to hold back
        deadline = time.monotonic() + TIMEOUT_S
        while dist.is_initialized() and dist.group.WORLD is self.group and time.monotonic() < deadline:
            time.sleep(0.001)


def leaves_while_a_callback_holds_the_group(port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = LiveGroup(connect("127.0.0.1", port, TIMEOUT_S), 0, Patience(STALE_S, 10.0, TIMEOUT_S))
    threads = []
    for generation in range(20):  # until the case arose a few times (not when the machine is busy)
        if sum(threads) >= 3:
            break
        group.form(generation, (0,))
        holder = LateHolder(dist.group.WORLD)

        def average(done, holder=holder):
            threads.append(threading.current_thread() is not threading.main_thread())
            return done.value()

        # Large enough that the callback is attached before the all-reduce is done, so it
        # runs on gloo's thread (a callback attached to a done future runs here).
        future = dist.all_reduce(torch.ones(1 << 22), async_op=True).get_future().then(average)
        del holder, average
        future.wait()
        del future
        group.leave()  # the callback's closure may still hold the group here
    (Path(out_dir) / "threads.json").write_text(json.dumps(threads))
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_group_a_callback_still_holds_is_freed_by_the_rank_not_on_gloos_thread(tmp_path):
    # Freed on gloo's worker thread, the group's destructor joins that thread itself and
    # the process aborts (SIGABRT, "Resource deadlock avoided").
    store = master_store()
    process = mp.get_context("forkserver").Process(target=leaves_while_a_callback_holds_the_group,
                                              args=(store.port, str(tmp_path)))
    process.start()
    process.join(timeout=100)
    assert process.exitcode == 0
    assert any(json.loads((tmp_path / "threads.json").read_text()))  # the case arose


def keeps_its_error() -> None:
    """Fails inside a call that holds the group and keeps the error in a variable of the
    frame its traceback passes through: that frame and the error hold each other (a cycle
    only the collector frees), and the frame below holds the group."""

    def collective(process_group: dist.ProcessGroup) -> None:
        raise RuntimeError(f"a peer of {process_group.size()} was lost")  # as a failed all-reduce does

    try:
        collective(dist.group.WORLD)
    except RuntimeError as e:
        error = e  # noqa: F841  (kept past the except block: the frame -> error -> traceback -> frame cycle)


def stays_until_the_peer_is_done(store: dist.TCPStore) -> None:
    """Slot 0, having left: alive (its sockets its own) until slot 1 has failed or timed out."""
    store.wait(["slot1/done"])
    os._exit(0)


def records_how_long_its_collective_waits(group: LiveGroup, store: dist.TCPStore, out_dir: str) -> None:
    """Slot 1: an all-reduce with slot 0, which has left; how long until it failed."""
    started = time.monotonic()
    try:
        total(group)
        error = None
    except (RuntimeError, dist.DistError) as e:
        error = str(e).splitlines()[0]
    (Path(out_dir) / "slot1.json").write_text(json.dumps({"failed_after_s": time.monotonic() - started,
                                                          "error": error}))
    store.set("slot1/done", "1")
    os._exit(0)


def slot1_record(target, tmp_path: Path) -> dict:
    """Runs `target` as slots 0 and 1 over a new store; slot 1's record."""
    store = master_store()
    context = mp.get_context("forkserver")
    processes = [context.Process(target=target, args=(slot, store.port, str(tmp_path))) for slot in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=100)
        assert process.exitcode == 0
    return json.loads((tmp_path / "slot1.json").read_text())


def leaves_holding_the_group_in_a_cycle(slot: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = connect("127.0.0.1", port, TIMEOUT_S)
    group = LiveGroup(store, slot, Patience(STALE_S, 10.0, TIMEOUT_S))
    group.form(0, (0, 1))
    total(group)
    if slot == 0:  # moves on from the generation while slot 1 is in a collective with it
        keeps_its_error()
        group.leave()
        stays_until_the_peer_is_done(store)
    records_how_long_its_collective_waits(group, store, out_dir)


@pytest.mark.timeout(120)
def test_a_peer_blocked_on_a_member_that_left_fails_at_once_though_a_cycle_held_the_group(tmp_path):
    # A group destroyed but still held keeps its sockets open: slot 1 would wait out the
    # whole collective timeout (30 s) on a member that has already moved on.
    record = slot1_record(leaves_holding_the_group_in_a_cycle, tmp_path)
    assert record["error"] is not None
    assert record["failed_after_s"] < TIMEOUT_S / 3, record  # at the group's release, not the timeout


def leaves_after_a_step_through_ddp(slot: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from disttrain.config import Config
    from disttrain.strategies.ddp.live.trainer import LiveTrainer
    store = connect("127.0.0.1", port, TIMEOUT_S)
    trainer = LiveTrainer(Config().replace(
        training={"dataset": "digits", "model_architecture": "mlp", "batch_size": 8, "num_epochs": 1},
        system={"num_workers": 2}), slot)
    group = LiveGroup(store, slot, Patience(STALE_S, 10.0, TIMEOUT_S))
    group.form(0, (0, 1))
    trainer.attach(group.rank, group.world_size)
    live_step(trainer)  # through the generation's DDP module
    if slot == 0:  # leaves while slot 1 is in a collective with it, as a live rank leaves
        trainer.detach()
        group.leave()
        stays_until_the_peer_is_done(store)
    records_how_long_its_collective_waits(group, store, out_dir)


@pytest.mark.timeout(120)
def test_a_peer_blocked_on_a_member_that_left_fails_at_once_after_steps_through_ddp(tmp_path):
    # The DDP module, and the torch module it imports as it wraps a model, must not keep a
    # generation's group once the member has left it (see `live.group`'s imports).
    record = slot1_record(leaves_after_a_step_through_ddp, tmp_path)
    assert record["error"] is not None
    assert record["failed_after_s"] < TIMEOUT_S / 3, record  # at the group's release, not the timeout
