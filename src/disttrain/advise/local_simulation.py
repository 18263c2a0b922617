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
`streaming_step_s` (a test).

Failures (`StepTimes.failure_rate`, per inner step) are recovered as a collective
recovers them: the failed worker loses its step and the inner steps it computed since its
last exchange (the state its recovery goes back to: nothing of them was exchanged), is
back `StepTimes.restart_s` after the failure (which counts its detection, `detect_s`, as
the parameter server's replay does), and computes them again, each of them liable to fail
in turn; the other workers go on to their sync step and the exchange, which needs every
worker, waits for it. That is DDP's restart recovery (the whole group back to its
checkpoint, taken here to be the last exchange: with equal step times the same steps
redone by the same time, though there every rank redoes them and here the failed
worker's alone count as lost) and a parameter-server worker that redoes its round from
its checkpoint; the parameter server's synchronous step, which stops waiting for a worker
`detect_s` after it fails and goes on without its round, costs less (this is its upper
bound), and DDP's live recovery (the survivors redo the round without the lost rank) is
not replayed. A failure's step, its lost steps and their redoing are drawn from a random
stream of their own, so a run with failures draws the very step times of the same run
without, and is never faster (a property test).
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

        Failures: `num_failures`, and `num_steps_lost` the inner steps they cost (the
        failed ones and those since each worker's last exchange, all computed again).

    Raises:
        ValueError: the setup is not local updates'.
    """
    if setup.mode != "local":
        raise ValueError(f"simulate_local_updates replays mode local, not {setup.mode!r}")
    started = time.perf_counter()
    n, h = setup.num_workers, setup.sync_every
    rng = random.Random(setup.seed)
    faults = _Faults(step_times, random.Random(f"{setup.seed}/failures"))
    stragglers = step_times.stragglers(n, rng)
    slow = [i in stragglers for i in range(n)]
    sync_residues = {f * h // setup.fragments % h for f in range(setup.fragments)}
    steps = setup.steps_per_worker or setup.num_updates
    clocks = [0.0] * n
    in_flight: deque[tuple[int, float]] = deque()  # (the step after which it is waited for, its end)
    link_free_s = blocked_s = 0.0
    num_exchanges = num_landed = 0
    last_sync = 0  # the last step an exchange followed: what a failed worker goes back to
    for step in range(1, steps + 1):
        for i in range(n):
            clocks[i] += step_times.draw(rng, slow[i])
            if faults.fail():
                clocks[i] = faults.recover(clocks[i], step - last_sync, slow[i])
        # the epoch's last step exchanges every fragment (those of other steps' residues
        # too), each waited for at once
        last = setup.steps_per_worker is not None and step == steps
        due = setup.fragments if last else int(step % h in sync_residues)
        if due:
            last_sync = step
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
                            num_failures=faults.num_failures, staleness_histogram={},
                            wall_s=time.perf_counter() - started, num_events=steps,
                            num_exchanges=num_exchanges, exchange_bytes=num_exchanges * exchange_bytes,
                            peak_bytes=exchange_bytes if num_exchanges else 0.0,
                            blocked_s=blocked_s / (n * num_landed) if num_landed else 0.0,
                            num_steps_lost=faults.num_steps_lost)


class _Faults:
    """Failures of inner steps and their recovery, on a random stream of their own."""

    def __init__(self, step_times: StepTimes, rng: random.Random):
        self.step_times, self.rng = step_times, rng
        self.num_failures = self.num_steps_lost = 0

    def fail(self) -> bool:
        """Whether the step just computed failed (never draws without failures)."""
        return self.step_times.fails(self.rng)

    def recover(self, failed_s: float, num_lost: int, straggler: bool) -> float:
        """A worker failed at `failed_s` with `num_lost` steps since its last exchange (its
        failed step included): it is back `restart_s` later and computes them again, each
        liable to fail in turn (then back again to the same exchange, what it redid lost
        too). Returns when the failed step is computed again."""
        clock, lost_now = failed_s, num_lost
        while True:
            self.num_failures += 1
            self.num_steps_lost += lost_now
            clock += self.step_times.restart_s
            for redone in range(1, num_lost + 1):
                clock += self.step_times.draw(self.rng, straggler)
                if self.fail():
                    lost_now = redone  # what it redid, the step that failed included
                    break
            else:
                return clock
