"""A discrete-event simulation of a parameter-server run in virtual time, deciding with the
project's own aggregation rules (`AggregationRules`, which take their clock as an
argument): sync, sync with backup workers, SSP(τ) and async, at up to 1,024 workers.

Each worker computes for a drawn time (`StepTimes`), encodes and pushes (the
communication of the cost model's `RoundTrip`), and the shard, one FIFO of work, takes
the push for `service_s` before it offers it to the rules at that virtual instant. What
the rules decide is what happens: a buffered push waits for its synchronous step; an
applied update is published `apply_s` later and pulled by every worker waiting for it; a
late push (sync, backup workers) or a stale one (SSP by versions) is dropped and its
worker pulls the current version and computes again. SSP by steps (the default, Ho et
al.) drops nothing: a worker whose push leaves it more than tau steps ahead of the
slowest worker that counts (`AggregationRules.may_go_on`) is held, as the shard holds its
reply, and pulls once the slowest catches up (its push published); every other worker
pulls at once, as in async. A failed worker loses its step; the run's membership
drops it `detect_s` later (so a synchronous step stops waiting for it) and takes it back
when it restarts. With constant step times and no failures the synchronous result is the
cost model's step exactly (a test).

By default every worker has work without end and the run stops at `num_updates`: the
steady state of a long run. With `steps_per_worker`, each worker has that many steps of
data (a real epoch's share, the same for all) and stops once they are pushed; the run ends
when the last worker does. A fast worker that ends its share early no longer carries the
run, as in a real run without `--balance`.

The shards are simulated as one: S shards decide the same way on the same pushes, each
on its slice, so the round trip's times already hold the S-fold split.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Any

from disttrain.advise.costmodel import RoundTrip
from disttrain.advise.step_times import StepTimes
from disttrain.strategies.ps.server.aggregation import SSP_CLOCKS, AggregationRules, Decision, Outcome, Push

MODES = ("sync", "ssp", "async", "local")  # local: `advise.local_simulation` replays it
_FAILED, _ARRIVED, _OFFERED, _PULLED, _DETECTED, _RESTARTED = range(6)


@dataclass(frozen=True)
class SimulationSetup:
    """What is simulated.

    Args:
        mode: sync, ssp or async (the rules), or local (local updates, replayed by
            `advise.local_simulation`).
        num_workers: workers in the run.
        num_updates: stop once the shard applied this many updates (versions).
        staleness_bound: ssp's tau.
        backup_workers: sync: a step is applied once all but this many workers pushed.
        batch_size: samples per push.
        seed: of the draws.
        steps_per_worker: each worker's share of the data, in steps (None: without end;
            the run stops at `num_updates`).
        ssp_clock: what ssp's tau counts: "steps" (a worker waits once tau steps ahead of
            the slowest) or "versions" (a gradient more than tau versions old is refused).
        sync_every: local: H inner steps between exchanges.
        fragments: Streaming DiLoCo's F fragments, each exchanged every H steps, staggered.
        delay: Streaming DiLoCo's tau: inner steps an exchange overlaps before it is waited for.
    """

    mode: str
    num_workers: int
    num_updates: int = 1000
    staleness_bound: int = 2
    backup_workers: int = 0
    batch_size: int = 64
    seed: int = 0
    steps_per_worker: int | None = None
    ssp_clock: str = "steps"
    sync_every: int = 1
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"simulation mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.ssp_clock not in SSP_CLOCKS:
            raise ValueError(f"ssp clock {self.ssp_clock!r} is not one of {', '.join(SSP_CLOCKS)}")
        if self.num_updates < 2:
            raise ValueError(f"num_updates {self.num_updates} must be >= 2")
        if self.steps_per_worker is not None and self.steps_per_worker < 1:
            raise ValueError(f"steps_per_worker {self.steps_per_worker} must be >= 1")
        if self.sync_every < 1:
            raise ValueError(f"sync_every {self.sync_every} must be >= 1")
        if self.mode == "local" and self.backup_workers:
            raise ValueError("local updates wait for every worker: backup_workers must be 0")
        if self.mode != "local" and (self.sync_every, self.fragments, self.delay) != (1, 1, 0):
            raise ValueError("sync_every, fragments and delay are local updates': mode local")
        if not 1 <= self.fragments <= self.sync_every:
            raise ValueError(f"{self.fragments} fragments need 1 to H = {self.sync_every} of them")
        if not 0 <= self.delay < max(1, self.sync_every):
            raise ValueError(f"delay {self.delay} must be in [0, H = {self.sync_every})")


@dataclass
class SimulationResult:
    setup: SimulationSetup
    num_updates: int
    virtual_time_s: float
    time_per_update_s: float
    samples_per_s: float
    num_pushes: int
    num_dropped_late: int
    num_rejected_stale: int
    num_failures: int
    staleness_histogram: dict[int, int]
    wall_s: float
    counts: dict[str, int] = field(default_factory=dict)
    num_events: int = 0  # events handled: the simulation's work, whatever the machine's speed
    # local updates (`advise.local_simulation`): exchanges made, the bytes one worker sent
    # and received in them, the largest exchange's, and the mean time a worker's step
    # waited for an exchange
    num_exchanges: int = 0
    exchange_bytes: float = 0.0
    peak_bytes: float = 0.0
    blocked_s: float = 0.0
    # local updates: inner steps failures lost (each failed step and the steps since its
    # worker's last exchange), all computed again
    num_steps_lost: int = 0

    @property
    def work_dropped_fraction(self) -> float:
        """Share of computed gradients the rules dropped (late, stale) or a failure lost
        (local updates: of the inner steps computed, those lost)."""
        if self.setup.mode == "local":
            done = self.setup.num_workers * self.num_updates
            return self.num_steps_lost / max(1, done + self.num_steps_lost)
        wasted = self.num_dropped_late + self.num_rejected_stale + self.num_failures
        return wasted / max(1, self.num_pushes + self.num_failures)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.setup.mode, "num_workers": self.setup.num_workers,
                "staleness_bound": self.setup.staleness_bound, "backup_workers": self.setup.backup_workers,
                "num_updates": self.num_updates, "virtual_time_s": self.virtual_time_s,
                "time_per_update_s": self.time_per_update_s, "samples_per_s": self.samples_per_s,
                "num_pushes": self.num_pushes, "num_dropped_late": self.num_dropped_late,
                "num_rejected_stale": self.num_rejected_stale, "num_failures": self.num_failures,
                "work_dropped_fraction": self.work_dropped_fraction,
                "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
                "sync_every": self.setup.sync_every, "outer_fragments": self.setup.fragments,
                "outer_delay": self.setup.delay, "num_exchanges": self.num_exchanges,
                "exchange_bytes": self.exchange_bytes, "peak_bytes": self.peak_bytes,
                "blocked_s": self.blocked_s, "num_steps_lost": self.num_steps_lost,
                "num_events": self.num_events, "wall_s": self.wall_s}


@dataclass
class _Worker:
    worker_id: str
    straggler: bool
    base_version: int = 0
    step: int = 0
    generation: int = 0
    waiting: bool = False  # pushed into a synchronous step, waiting for its update
    away: bool = False


class Simulation:
    """One simulated run; `run()` once."""

    def __init__(self, setup: SimulationSetup, step_times: StepTimes, trip: RoundTrip):
        self.setup, self.step_times, self.trip = setup, step_times, trip
        self.rng = random.Random(setup.seed)
        mode = "sync" if setup.mode == "sync" else setup.mode
        self.rules = AggregationRules(mode, setup.num_workers, setup.staleness_bound,
                                      setup.backup_workers if mode == "sync" else 0,
                                      ssp_clock=setup.ssp_clock)
        # SSP by steps: the workers whose replies are held, as (the slowest clock that lets
        # each go on, its index), lowest first
        self.held: list[tuple[int, int]] = []
        stragglers = step_times.stragglers(setup.num_workers, self.rng)
        self.workers = [_Worker(f"worker-{i}", i in stragglers) for i in range(setup.num_workers)]
        for worker in self.workers:
            self.rules.register(worker.worker_id, int(worker.worker_id.split("-")[1]))
        self.uses_membership = step_times.failure_rate > 0
        self.generation = 0
        self.members: dict[str, int] = {}
        if self.uses_membership:  # the coordinator's view, so a failed worker can leave the quorum
            self.generation = 1
            self.members = {w.worker_id: 1 for w in self.workers}
            for w in self.workers:
                w.generation = 1
            self.rules.set_membership(1, self.members, 0.0)
        self.events: list[tuple[float, int, int, int]] = []
        self.sequence = 0
        self.shard_free_s = 0.0
        self.update_times: list[float] = []
        self.num_pushes = 0
        self.num_failures = 0
        self.finished_s = 0.0  # when the last worker with a share ended it
        self.num_events = 0

    def _at(self, when: float, kind: int, index: int) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, kind, index))

    def _start_step(self, index: int, now: float) -> None:
        """The worker computes; its push reaches the shard when its step, encoding and
        push are done (one event, not three: a million pushes cost seconds, not minutes)."""
        worker = self.workers[index]
        computed = now + self.step_times.draw(self.rng, worker.straggler)
        if self.step_times.fails(self.rng):
            self._at(computed, _FAILED, index)
            return
        # with overlap the push left before backward ended (overlap_s <= encode_s + push_s)
        trip = self.trip
        self._at(computed + trip.encode_s - trip.overlap_s + trip.push_s, _ARRIVED, index)

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        for index in range(len(self.workers)):
            self._start_step(index, 0.0)
        handlers = {_FAILED: self._failed, _ARRIVED: self._arrived, _OFFERED: self._offered,
                    _PULLED: self._pulled, _DETECTED: self._detected, _RESTARTED: self._restarted}
        now, shares = 0.0, self.setup.steps_per_worker is not None
        while self.events and (shares or self.rules.version < self.setup.num_updates):
            now, _, kind, index = heapq.heappop(self.events)
            self.num_events += 1
            handlers[kind](index, now)
        return self._result(self.finished_s if shares else now, time.perf_counter() - started)

    # -- events ----------------------------------------------------------------------------

    def _failed(self, index: int, now: float) -> None:
        """The worker failed during this step: its work is lost."""
        self.num_failures += 1
        self.workers[index].away = True
        self._at(now + self.step_times.detect_s, _DETECTED, index)
        self._at(now + self.step_times.restart_s, _RESTARTED, index)

    def _arrived(self, index: int, now: float) -> None:
        self.shard_free_s = max(self.shard_free_s, now) + self.trip.service_s
        self._at(self.shard_free_s, _OFFERED, index)

    def _offered(self, index: int, now: float) -> None:
        worker = self.workers[index]
        worker.step += 1
        self.num_pushes += 1
        push = Push(worker.worker_id, worker.step, worker.base_version, float(self.setup.batch_size),
                    generation=worker.generation)
        decision = self.rules.offer(push, index, now)
        if decision.outcome is Outcome.BUFFERED:
            worker.waiting = True
        elif decision.outcome in (Outcome.LATE, Outcome.STALE):
            self._at(now + self.trip.pull_s, _PULLED, index)
        elif self.rules.bounds_steps:  # applied on arrival; its worker pulls once within the bound
            published = self._published(decision, now, [])
            if self.rules.may_go_on(index, worker.step, 0):
                self._at(published + self.trip.pull_s, _PULLED, index)
            else:
                heapq.heappush(self.held, (worker.step - self.setup.staleness_bound, index))
            self._release(published)
        elif self.setup.mode != "sync":  # applied on arrival: this worker pulls the result
            self._published(decision, now, [index])
        if decision.outcome is Outcome.APPLIED and self.setup.mode == "sync":
            worker.waiting = True
            self._published(decision, now, None)

    def _release(self, now: float) -> None:
        """SSP by steps: the held workers the slowest clock now lets go on pull what is
        published at `now` (the slowest worker's update, or a worker leaving the count)."""
        if not self.held:
            return
        slowest = self.rules.slowest_clock(0)
        while self.held and (slowest is None or self.held[0][0] <= slowest):
            _, index = heapq.heappop(self.held)
            self._at(now + self.trip.pull_s, _PULLED, index)

    def _published(self, decision: Decision, now: float, readers: list[int] | None) -> float:
        """An update was applied: it is published `apply_s` later and pulled by `readers`
        (None: every worker waiting for a synchronous step); when it is published."""
        published = now + self.trip.apply_s
        self.shard_free_s = max(self.shard_free_s, now) + self.trip.apply_s  # the pushes queued wait
        self.update_times.append(published)
        if readers is None:
            readers = [i for i, w in enumerate(self.workers) if w.waiting]
        for i in readers:
            self.workers[i].waiting = False
            self._at(published + self.trip.pull_s, _PULLED, i)
        return published

    def _pulled(self, index: int, now: float) -> None:
        worker = self.workers[index]
        if worker.away:
            return
        worker.base_version = self.rules.version
        quota = self.setup.steps_per_worker
        if quota is not None and worker.step >= quota:  # its share is done: it says so, as
            self.finished_s = max(self.finished_s, now)  # a worker's WorkerDone does
            decision = self.rules.mark_done(worker.worker_id, now)
            if decision.apply:  # the pending synchronous step no longer waits for it
                self._published(decision, now, None)
            self._release(now)  # nor does a worker it held
            return
        self._start_step(index, now)

    def _detected(self, index: int, now: float) -> None:
        """The run notices the failure: the worker leaves the membership (and the quorum)."""
        self.generation += 1
        self.members.pop(self.workers[index].worker_id, None)
        decision = self.rules.set_membership(self.generation, self.members, now)
        if decision.advanced:
            self._published(decision, now, None)
        self._release(now)

    def _restarted(self, index: int, now: float) -> None:
        worker = self.workers[index]
        self.generation += 1
        self.members[worker.worker_id] = worker.generation = self.generation
        self.rules.set_membership(self.generation, self.members, now)
        self.rules.register(worker.worker_id)
        worker.away = False
        self._at(now + self.trip.pull_s, _PULLED, index)

    def _result(self, now: float, wall_s: float) -> SimulationResult:
        times = self.update_times
        per_update = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
        counts = self.rules.counts
        samples = counts["samples"]
        elapsed = now if self.setup.steps_per_worker is not None else times[-1] if times else now
        return SimulationResult(self.setup, self.rules.version, elapsed, per_update,
                                samples / elapsed if elapsed > 0 else 0.0, self.num_pushes,
                                counts["dropped_late"], counts["rejected_stale"], self.num_failures,
                                dict(self.rules.staleness_histogram), wall_s, dict(counts), self.num_events)


def simulate(setup: SimulationSetup, step_times: StepTimes, trip: RoundTrip) -> SimulationResult:
    """Run one simulation (see the module's docstring).

    Raises:
        ValueError: the setup is local updates' (`advise.local_simulation` replays them).
    """
    if setup.mode == "local":
        raise ValueError("local updates are replayed by simulate_local_updates")
    return Simulation(setup, step_times, trip).run()
