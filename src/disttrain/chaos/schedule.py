"""Fault schedules drawn from a seed: which faults a run meets, against which process, when.

A schedule is a handful of *patterns*, each one of the interactions faults have with
recovery, drawn with `random.Random(seed)` against a scenario's processes and steps:

- `single`: one fault of any kind at any step (kill, hang, partition, a delayed or lost
  reply, a slow link, a full store, a crash in the middle of a checkpoint write).
- `twice-before-checkpoint`: a process killed, then killed again after its restart and
  before its next checkpoint (it comes back from the same checkpoint twice).
- `during-recovery`: a process killed, then again at its first step back, or another
  process killed while the first one recovers.
- `epoch-boundary`: a fault on the last step of an epoch, before its evaluation.
- `in-checkpoint`: a process killed while it writes a checkpoint.
- `hostile`: from outside, by the clock: a random process SIGKILLed every few seconds,
  as a hostile world does (the run must go on as long as it makes progress).
- `preemption`: drawn apart from the others, for a scenario that is `preemptible`: one or
  two SIGTERMs from outside (to the launcher, or to one worker or rank) once the run
  reaches a drawn step, each preempted launch resumed with `--resume`, on a number of
  workers (ranks) drawn among those that keep the global batch where the scenario is
  `resizable` (a planned leave when fewer, a join when more). Alone in its schedule half
  the time or more (so what a preempted run promises alone, bit-identity, is checked),
  else after the other patterns, whose faults all fire in the first launch.
- `elastic`: for a scenario that grows and shrinks while it runs (`max_workers`), and
  for it alone: changes of size, each once the run reaches a drawn step (`chaos.elastic`):
  for the parameter server a grow (SIGUSR1 to the launcher, up to MAX) or a planned leave
  (SIGTERM to one worker, down to MIN); for a live DDP group an arrival (`--join`), a
  planned leave (SIGTERM to a rank or to an arrival's launcher) or a rank's death. The run
  changes size by itself and must end normally.

Step-triggered faults travel as `--inject` specs (they fire inside the process at an
exact step, so they reproduce); clock-triggered ones (`TimedFault`) are sent from
outside. Each process's restarts are counted as the schedule is drawn, so a fault meant
for a restarted process names the start it fires on (`attempt`). Pure: no process, no
clock; `lines()` is what is printed and saved with a result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from disttrain.chaos.elastic import LiveChange, Resize, draw_live_changes, draw_resizes
from disttrain.chaos.scenarios import Scenario
from disttrain.core.fault_spec import Fault, format_fault, parse_fault

LAUNCHER = "launcher"
PATTERNS = ("single", "twice-before-checkpoint", "during-recovery", "epoch-boundary", "in-checkpoint",
            "hostile")
# One fault of any kind: (action, roles it applies to).
KINDS = (("kill", ("worker", "server", "rank", "coordinator")),
         ("stop", ("worker", "server", "rank", "coordinator")),
         ("partition", ("worker", "server", "coordinator")),
         ("drop-rpc", ("worker",)),
         ("delay-rpc", ("worker",)),
         ("slow-link", ("worker", "server")),
         ("slow", ("worker", "rank")),
         ("store-error", ("worker", "server", "rank")),
         ("crash-checkpoint", ("worker", "server", "rank")))
# A preemptible scenario's schedules draw preemptions this often; alone half of those times.
PREEMPTION_SHARE, PREEMPTION_ALONE = 0.3, 0.5
MAX_PREEMPTIONS = 2
# The worker steps a preemption is sent from: late enough that the run has trained, early
# enough that it has not ended before the signal lands (the registry hears of a step a
# heartbeat late), and apart enough that each resumed launch trains before its own.
PREEMPTION_MARGIN_STEPS = 12
# Hangs and cuts are either short (well within the heartbeat timeout: the process is
# waited for) or long (several timeouts: it is declared failed, killed and restarted).
SHORT, LONG = 0.4, 3.0


@dataclass(frozen=True)
class TimedFault:
    """A fault sent from outside at `at_s` seconds after every worker joined: SIGKILL
    (`kill`) or SIGSTOP then SIGCONT `seconds` later (`stop`), to process `index` of
    `role` as it runs then."""

    at_s: float
    action: str
    role: str
    index: int
    seconds: float = 0.0

    def describe(self) -> str:
        hang = f" for {self.seconds:g}s" if self.action == "stop" else ""
        return f"at {self.at_s:.1f}s: {self.action} {self.role} {self.index}{hang} (from outside)"


@dataclass(frozen=True)
class Preemption:
    """A SIGTERM sent from outside to `target` (`launcher`, or the role of the members:
    `worker` or `rank`, number `index`) once a member of the launch has reported worker
    step `step`; the run, stopped, is resumed with `--resume` on `size` workers (ranks)."""

    step: int
    target: str
    index: int
    size: int

    def describe(self, unit: str = "worker") -> str:
        whom = "the launcher" if self.target == LAUNCHER else f"{self.target} {self.index}"
        unit += "" if self.size == 1 else "s"
        return f"preempt at step {self.step}: SIGTERM to {whom}, resumed on {self.size} {unit} (from outside)"


@dataclass(frozen=True)
class Schedule:
    """The faults of one run: `faults` inside the processes, `timed` from outside, and
    the `preemptions` that end its launches one after the other, and the `resizes` of
    an elastic PS run or the `live_changes` of an elastic live DDP group."""

    scenario: str
    seed: int
    patterns: tuple[str, ...]
    faults: tuple[Fault, ...] = ()
    timed: tuple[TimedFault, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    resizes: tuple[Resize, ...] = ()
    live_changes: tuple[LiveChange, ...] = ()

    def lines(self) -> list[str]:
        """The schedule as printed: one line per fault."""
        unit = "rank" if self.scenario.startswith("ddp") else "worker"
        return [*(format_fault(f) for f in self.faults), *(t.describe() for t in self.timed),
                *(p.describe(unit) for p in self.preemptions), *(r.describe() for r in self.resizes),
                *(c.describe() for c in self.live_changes)]

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "seed": self.seed, "patterns": list(self.patterns),
                "inject": [format_fault(f) for f in self.faults],
                "timed": [vars(t) for t in self.timed],
                "preemptions": [vars(p) for p in self.preemptions],
                "resizes": [vars(r) for r in self.resizes],
                "live_changes": [vars(c) for c in self.live_changes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        return cls(data["scenario"], int(data["seed"]), tuple(data["patterns"]),
                   tuple(parse_fault(text) for text in data["inject"]),
                   tuple(TimedFault(**t) for t in data["timed"]),
                   tuple(Preemption(**p) for p in data.get("preemptions", ())),
                   tuple(Resize(**r) for r in data.get("resizes", ())),
                   tuple(LiveChange(**c) for c in data.get("live_changes", ())))


@dataclass(frozen=True)
class Extent:
    """How long or how much a fault lasts: `seconds` (a stop, a partition, a delay; a slow
    link's per-message delay), `factor` (a slowed process's), `until` (the worker step a
    slowing ends at; 0: none)."""

    seconds: float = 0.0
    factor: float = 1.0
    until: int = 0


@dataclass
class _Draw:
    """The state of one schedule being drawn: its random source and each process's start."""

    scenario: Scenario
    rng: random.Random
    attempts: dict[tuple[str, int], int] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    timed: list[TimedFault] = field(default_factory=list)

    def process(self, roles: tuple[str, ...]) -> tuple[str, int] | None:
        """A random process of one of `roles` that the scenario has, or None."""
        present = [(role, index) for role, count in self.scenario.processes().items() if role in roles
                   for index in range(count)]
        return self.rng.choice(present) if present else None

    def step(self, low: int = 2, high: int | None = None) -> int:
        """A random worker step in [low, high] (default: up to two before the end)."""
        high = self.scenario.total_steps - 2 if high is None else high
        return self.rng.randint(min(low, high), high)

    def add(self, action: str, target: tuple[str, int], step: int, extent: Extent = Extent(),
            own_step: bool = False) -> Fault:
        """A fault at worker step `step` (`own_step`: at the target's own step, a shard's
        version) on the process's current start; a fault that restarts the process (a
        kill, a crash, a hang or cut past the heartbeat timeout) moves it to its next start."""
        role, index = target
        seconds, until = extent.seconds, extent.until
        scenario = self.scenario
        convert = (lambda s: s) if own_step else (lambda s: scenario.role_step(role, s))
        fault = Fault(action, convert(step), round(seconds, 3), None if role == "coordinator" else index,
                      self.attempts.get(target, 0), role=role, factor=extent.factor,
                      until=convert(until) if until else 0)
        self.faults.append(fault)
        if restarts(action, seconds, scenario):
            for process in ([(role, i) for i in range(scenario.processes()[role])] if scenario.group_restart
                            else [target]):
                self.attempts[process] = self.attempts.get(process, 0) + 1
        return fault

    def spent(self, target: tuple[str, int]) -> bool:
        """Whether the process has no restart left to spend on a crash loop."""
        return self.attempts.get(target, 0) >= self.scenario.max_restarts


def restarts(action: str, seconds: float, scenario: Scenario) -> bool:
    """Whether a fault of `action` lasting `seconds` ends with the process restarted."""
    if action in ("kill", "crash-checkpoint"):
        return True
    return action in ("stop", "partition") and seconds > scenario.heartbeat_timeout_s


def draw(scenario: Scenario, seed: int, max_patterns: int = 2) -> Schedule:
    """The schedule of `seed` for `scenario`: 1 to `max_patterns` patterns, and for a
    preemptible scenario, sometimes preemptions (alone, or after those patterns).

    The same scenario and seed always give the same schedule. The preemptions are drawn
    from a random source of their own, so the other patterns of a seed are those it drew
    before preemptions existed (the regression tests named by a seed keep their faults).
    An elastic scenario's schedules are its changes of size alone (`chaos.elastic`).
    """
    if scenario.max_workers:
        elastic = random.Random(f"{scenario.name}/{seed}/elastic")
        if scenario.command == "ddp":
            changes = draw_live_changes(scenario, elastic)
            return Schedule(scenario.name, seed, ("elastic",), live_changes=changes)
        return Schedule(scenario.name, seed, ("elastic",), resizes=draw_resizes(scenario, elastic))
    rng = random.Random(f"{scenario.name}/{seed}")
    state = _Draw(scenario, rng)
    patterns = tuple(rng.choice(PATTERNS) for _ in range(rng.randint(1, max_patterns)))
    for pattern in patterns:
        DRAWERS[pattern](state)
    preempting = random.Random(f"{scenario.name}/{seed}/preemption")
    if not scenario.preemptible or preempting.random() >= PREEMPTION_SHARE:
        return Schedule(scenario.name, seed, patterns, tuple(state.faults), tuple(state.timed))
    alone = preempting.random() < PREEMPTION_ALONE
    # With other patterns, the preemptions come after their last step-triggered fault (every
    # fault fires in the first launch, whose processes count their starts from 0 as drawn);
    # where there is no room left for one, the preemptions are alone.
    after = max((worker_step(scenario, f) for f in state.faults), default=0)
    if not alone and after + PREEMPTION_MARGIN_STEPS <= last_preemption_step(scenario):
        return Schedule(scenario.name, seed, (*patterns, "preemption"), tuple(state.faults),
                        tuple(state.timed), draw_preemptions(scenario, preempting, after))
    return Schedule(scenario.name, seed, ("preemption",), preemptions=draw_preemptions(scenario, preempting))


def worker_step(scenario: Scenario, fault: Fault) -> int:
    """The worker step at which `fault` fires (a shard's steps are versions: see `role_step`),
    or at which a slow one ends."""
    step = max(fault.step, fault.until)
    return step // scenario.workers if scenario.role_step(fault.role, 1) != 1 else step


def last_preemption_step(scenario: Scenario) -> int:
    """The latest worker step a preemption of `scenario` is drawn at."""
    return min(scenario.total_steps - PREEMPTION_MARGIN_STEPS,
               int(scenario.total_steps * scenario.preempt_before))


def draw_preemptions(scenario: Scenario, rng: random.Random, after: int = 0) -> tuple[Preemption, ...]:
    """One or two preemptions of `scenario` at increasing worker steps past `after`, each
    `PREEMPTION_MARGIN_STEPS` or more from the start, the end and the one before, each to
    the launcher or to one member of the launch it stops (whose size the preemption before
    it chose), each resumed on one of `scenario.sizes()`."""
    margin, last = PREEMPTION_MARGIN_STEPS, last_preemption_step(scenario)
    preemptions: list[Preemption] = []
    size, step = scenario.workers, after
    for _ in range(rng.randint(1, MAX_PREEMPTIONS)):
        if step + margin > last:
            break
        step = rng.randint(step + margin, step + margin + (last - step - margin) // 2)
        target = rng.choice((LAUNCHER, scenario.member_role))
        index = rng.randrange(size) if target != LAUNCHER else 0
        # Half the time on its own size (a resumed run that must end as if never stopped),
        # else a join (more) or a planned leave (fewer).
        others = [other for other in scenario.sizes() if other != size]
        size_next = rng.choice(others) if others and rng.random() < 0.5 else size
        preemptions.append(Preemption(step, target, index, size_next))
        size = size_next
    return tuple(preemptions)


def _any_fault(state: _Draw, step: int | None = None, target: tuple[str, int] | None = None) -> None:
    """One fault of a random kind the target (or a random process) can take."""
    rng, scenario = state.rng, state.scenario
    kinds = [(action, roles) for action, roles in KINDS
             if (target[0] in roles if target else any(r in roles for r in scenario.processes()))]
    action, roles = rng.choice(kinds)
    target = target or state.process(roles)
    if target is None:
        return
    if state.spent(target) and restarts(action, LONG, scenario):
        action = "slow-link" if target[0] in ("worker", "server") else "slow"
        if target[0] not in ("worker", "server", "rank"):
            return
    step = state.step() if step is None else step
    if action in ("stop", "partition"):
        state.add(action, target, step, Extent(rng.choice((SHORT, LONG)) * scenario.heartbeat_timeout_s))
    elif action in ("delay-rpc", "store-error"):
        state.add(action, target, step, Extent(round(rng.uniform(0.2, 3.0), 2)))
    elif action == "slow-link":
        state.add(action, target, step, Extent(round(rng.uniform(0.002, 0.02), 3),
                                               until=step + rng.randint(2, 8)))
    elif action == "slow":
        state.add(action, target, step, Extent(factor=round(rng.uniform(1.5, 4.0), 1),
                                               until=step + rng.randint(2, 8)))
    else:
        state.add(action, target, step)


def _single(state: _Draw) -> None:
    _any_fault(state)


def _killable(state: _Draw) -> tuple[str, int] | None:
    """A random process that can still be killed without ending the run."""
    for _ in range(8):
        target = state.process(("worker", "server", "rank", "coordinator"))
        if target is not None and not state.spent(target):
            return target
    return None


def _twice_before_checkpoint(state: _Draw) -> None:
    target = _killable(state)
    if target is None or target[0] == "coordinator":
        return _single(state)
    scenario = state.scenario
    interval = scenario.checkpoint_interval
    step = scenario.role_step(target[0], state.step(interval + 1, scenario.total_steps - interval))
    state.add("kill", target, step, own_step=True)
    if not state.spent(target):
        # Back from its checkpoint at or before `step`, killed again before its next one
        # (both in its own steps: a shard checkpoints by versions).
        restored = step - step % interval
        state.add("kill", target, state.rng.randint(restored + 1, restored + interval - 1), own_step=True)


def _during_recovery(state: _Draw) -> None:
    target = _killable(state)
    if target is None:
        return _single(state)
    step = state.step()
    state.add("kill", target, step)
    other = _killable(state)
    if state.rng.random() < 0.5 and not state.spent(target):
        again = "kill" if target[0] == "coordinator" else state.rng.choice(("kill", "crash-checkpoint"))
        state.add(again, target, 0)  # at its first step back
    elif other is not None and other != target:
        _any_fault(state, step + 1, other)


def _epoch_boundary(state: _Draw) -> None:
    scenario = state.scenario
    epoch = state.rng.randint(1, scenario.epochs - 1)
    _any_fault(state, epoch * scenario.steps_per_epoch)


def _in_checkpoint(state: _Draw) -> None:
    target = state.process(("worker", "server", "rank"))
    if target is None or state.spent(target):
        return _single(state)
    state.add("crash-checkpoint", target, state.step())


def _hostile(state: _Draw) -> None:
    """A SIGKILL of a random worker, server or rank every 2-6 s, from outside, four to
    eight times: more than any one process's restart budget if it lands on it often."""
    at_s = 0.0
    for _ in range(state.rng.randint(4, 8)):
        at_s += state.rng.uniform(2.0, 6.0)
        target = state.process(("worker", "server", "rank"))
        if target is not None:
            state.timed.append(TimedFault(round(at_s, 2), "kill", *target))


DRAWERS = {"single": _single, "twice-before-checkpoint": _twice_before_checkpoint,
           "during-recovery": _during_recovery, "epoch-boundary": _epoch_boundary,
           "in-checkpoint": _in_checkpoint, "hostile": _hostile}
