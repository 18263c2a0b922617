"""The ranks' agreement on a preemption's stop step, over a real gloo group of 2: for seeded
schedules (which rank raises its flag at which stop point, or none; each rank's own step
times, so each proposes its own spacing of the rounds), both ranks answer "stop" at the
same point, never before the first flag, and within two spacings of it; with no flag,
never. The plain blocking agreement answers at the very point of the flag."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.strategies.ddp.preemption import MAX_SPACING, StopAgreement, SyncStopAgreement

NUM_SCHEDULES = 30
NUM_POINTS = 300
WORLD_SIZE = 2


def schedule(seed: int) -> dict:
    """Seed -> the point each rank raises its flag at (None: never) and its step-time range."""
    rng = random.Random(seed)
    raises = [rng.choice([None, rng.randrange(NUM_POINTS)]) for _ in range(WORLD_SIZE)]
    step_ranges = [sorted((rng.uniform(0.0005, 0.08), rng.uniform(0.0005, 0.08))) for _ in range(WORLD_SIZE)]
    return {"raises": raises, "step_ranges": step_ranges}


def answers(rank: int, seed: int, plain: bool) -> int | None:
    """The point at which this rank's agreement says stop (None: never)."""
    plan = schedule(seed)
    rng = random.Random(seed * 1000 + rank)
    now = [0.0]
    flag = threading.Event()
    kind = SyncStopAgreement if plain else StopAgreement
    agreement = kind(flag, torch.device("cpu"), interval_s=0.05, clock=lambda: now[0])
    for point in range(NUM_POINTS):
        now[0] += rng.uniform(*plan["step_ranges"][rank])
        if plan["raises"][rank] == point:
            flag.set()
        if agreement.is_set():
            return point
    agreement.settle()
    return None


def rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    results = {str(seed): {"rounds": answers(rank, seed, plain=False),
                           "plain": answers(rank, seed, plain=True)} for seed in range(NUM_SCHEDULES)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # a process group of spawned ranks, tens of seconds
@pytest.mark.timeout(120)
def test_every_rank_stops_at_the_same_point_within_two_spacings_of_the_first_flag(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(rank_main, args=(store.port, str(tmp_path)), nprocs=WORLD_SIZE,
                       start_method="forkserver")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for seed in range(NUM_SCHEDULES):
        raised = [p for p in schedule(seed)["raises"] if p is not None]
        first = min(raised, default=None)
        for kind in ("rounds", "plain"):
            stops = {ranks[r][str(seed)][kind] for r in range(WORLD_SIZE)}
            assert len(stops) == 1, f"seed {seed}, {kind}: the ranks stopped at different points {stops}"
            stop = stops.pop()
            if first is None:
                assert stop is None, f"seed {seed}, {kind}: stopped at {stop} without a flag"
            elif kind == "plain":
                assert stop == first, f"seed {seed}: plain agreement stopped at {stop}, flag at {first}"
            else:
                assert stop is None or first < stop <= first + 2 * MAX_SPACING, \
                    f"seed {seed}: stopped at {stop}, flag at {first}"
                # The rounds' spacing covers about 50 ms of the slowest proposals: with steps of
                # at least 0.5 ms, never more than 100 points, so a flag raised well before the
                # end is always answered.
                if first + 2 * MAX_SPACING < NUM_POINTS:
                    assert stop is not None, f"seed {seed}: the flag at {first} was never answered"
