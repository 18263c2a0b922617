"""A replay of local updates in virtual time (`training.sync_every` H), with Streaming
DiLoCo's fragments and delay, for `disttrain advise --simulate`.

Each worker computes its inner steps (drawn from `StepTimes`: a log-normal tail,
stragglers) without exchanging. Fragment f of F (`training.outer_fragments`) is exchanged
after the steps s (counted from 1) where `(s - f·H//F) % H == 0`, the schedule of
`training.fragments`, so at most one fragment a step and, with F = 1, one exchange every
H steps. An exchange is collective: it starts once every worker has computed its sync
step and the link has carried the exchange before it (the exchanges share it one after
another), and lasts the cost model's time for one fragment
(`CostModel.fragment_exchange`, 1/F of the bytes): a straggler holds up every exchange.
Without delay a worker waits for it before its next step; with a delay tau
(`training.outer_delay`) it computes tau more steps while the exchange is in flight and
waits after step s + tau only for what is left.

With `steps_per_worker` (an epoch's share) the epoch's last step ends every round, as
`training.fragments` does: it waits for every exchange in flight, then exchanges each
fragment not exchanged at that step, one after another on the link, and waits for them
(every epoch ends with one model). Without it (the steady state of a long run) there is
no last step, and with constant step times the mean step is the cost model's
`streaming_step_s` (a test). Left out: failures (the rules' membership is the parameter
server's: `advise.simulation` replays them without local updates).
"""

from __future__ import annotations

import random
import time
from collections import deque

from disttrain.advise.simulation import SimulationResult, SimulationSetup
from disttrain.advise.step_times import StepTimes


def simulate_local_updates(setup: SimulationSetup, step_times: StepTimes, exchange_s: float,
                           exchange_bytes: float) -> SimulationResult:
    """Replay `setup.num_updates` inner steps of every worker (or `steps_per_worker`), with
    local updates every `setup.sync_every` steps in `setup.fragments` fragments delayed by
    `setup.delay` steps (see the module's docstring).

    Args:
        setup: the run; mode local.
        step_times: each inner step's compute (and optimizer) time.
        exchange_s, exchange_bytes: one fragment's exchange, as `CostModel.fragment_exchange`
            prices it at `setup.num_workers`.

    Returns:
        The result: `time_per_update_s` is the mean inner step, `blocked_s` the mean time a
        worker waited for an exchange, `peak_bytes` the largest exchange's bytes.

    Raises:
        ValueError: the setup is not local updates', or the step times fail workers
            (failures are replayed by `advise.simulation` only).
    """
    if setup.mode != "local":
        raise ValueError(f"simulate_local_updates replays mode local, not {setup.mode!r}")
    if step_times.failure_rate > 0:
        raise ValueError("failures are replayed by the parameter server's simulation, without local updates")
    started = time.perf_counter()
    n, h = setup.num_workers, setup.sync_every
    rng = random.Random(setup.seed)
    stragglers = step_times.stragglers(n, rng)
    slow = [i in stragglers for i in range(n)]
    sync_residues = {f * h // setup.fragments % h for f in range(setup.fragments)}
    steps = setup.steps_per_worker or setup.num_updates
    clocks = [0.0] * n
    in_flight: deque[tuple[int, float]] = deque()  # (the step after which it is waited for, its end)
    link_free_s = blocked_s = 0.0
    num_exchanges = num_landed = 0
    for step in range(1, steps + 1):
        for i in range(n):
            clocks[i] += step_times.draw(rng, slow[i])
        # the epoch's last step exchanges every fragment (those of other steps' residues
        # too), each waited for at once
        last = setup.steps_per_worker is not None and step == steps
        due = setup.fragments if last else int(step % h in sync_residues)
        for _ in range(due):
            ends = max(max(clocks), link_free_s) + exchange_s
            link_free_s = ends
            in_flight.append((step if last else step + setup.delay, ends))
            num_exchanges += 1
        while in_flight and (last or in_flight[0][0] <= step):
            _, ends = in_flight.popleft()
            num_landed += 1
            for i in range(n):
                if clocks[i] < ends:
                    blocked_s += ends - clocks[i]
                    clocks[i] = ends
    elapsed = max(clocks)
    samples = n * steps * setup.batch_size
    return SimulationResult(setup, steps, elapsed, elapsed / steps, samples / elapsed if elapsed > 0 else 0.0,
                            num_pushes=n * num_exchanges, num_dropped_late=0, num_rejected_stale=0,
                            num_failures=0, staleness_histogram={}, wall_s=time.perf_counter() - started,
                            num_events=steps, num_exchanges=num_exchanges,
                            exchange_bytes=num_exchanges * exchange_bytes,
                            peak_bytes=exchange_bytes if num_exchanges else 0.0,
                            blocked_s=blocked_s / (n * num_landed) if num_landed else 0.0)
