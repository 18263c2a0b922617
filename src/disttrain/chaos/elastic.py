"""The changes of size of an elastic run while it runs, drawn from a seed: pure, no process.

- `Resize` (`ps-elastic`, `disttrain ps --workers MIN:MAX`): a grow (SIGUSR1 to the
  launcher) or a planned leave (SIGTERM to one worker); every process restarts through a
  checkpoint at a step the workers agree on.
- `LiveChange` (`ddp-elastic`, `disttrain ddp --ddp-recovery live --world-size MIN:MAX`):
  an arrival (a `disttrain ddp ... --join` launcher started from outside), a planned leave
  (SIGTERM to a member rank, or to an arrival's launcher) or a member's death (SIGKILL:
  live recovery, the rank restarted by its launcher rejoins); the group re-forms at a step
  boundary, nobody restarts but the killed rank.

Each is sent once the run trains on the size before it and has reached the change's step,
so the sizes the run goes through follow from the schedule (`live_sizes`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from disttrain.chaos.scenarios import Scenario

# An elastic scenario's changes of size: at most this many, this many worker steps or more
# apart (and from the start and end): a change stops and restarts every process at a step
# its workers agree on a few steps past the signal, and the next must find the run
# training on its new size.
MAX_RESIZES, RESIZE_MARGIN_STEPS = 3, 30
GROW, LEAVE = "grow", "leave"


@dataclass(frozen=True)
class Resize:
    """A change of size of an elastic run, sent from outside once a worker of the run,
    at `size - 1` workers for a grow (`size + 1` for a leave), has reported worker step
    `step`: a `grow` (SIGUSR1 to the launcher) or a planned `leave` (SIGTERM to worker
    `index`); the run goes on on `size` workers by itself."""

    step: int
    action: str
    index: int
    size: int

    @property
    def before(self) -> int:
        """The workers of the run the change is sent to."""
        return self.size - 1 if self.action == GROW else self.size + 1

    def describe(self) -> str:
        what = "SIGUSR1 to the launcher (grow)" if self.action == GROW else \
            f"SIGTERM to worker {self.index} (planned leave)"
        return f"resize at step {self.step}: {what}, {self.before} to {self.size} workers (from outside)"


def draw_resizes(scenario: Scenario, rng: random.Random) -> tuple[Resize, ...]:
    """One to `MAX_RESIZES` changes of size of an elastic `scenario` at increasing worker
    steps, each `RESIZE_MARGIN_STEPS` or more from the start, the end and the one before;
    each a grow or a planned leave of a random worker, as the range allows (from
    `scenario.workers`, MIN, to `scenario.max_workers`)."""
    margin, last = RESIZE_MARGIN_STEPS, scenario.total_steps - RESIZE_MARGIN_STEPS
    resizes: list[Resize] = []
    size, step = scenario.workers, 0
    for _ in range(rng.randint(1, MAX_RESIZES)):
        if step + margin > last:
            break
        step = rng.randint(step + margin, step + margin + (last - step - margin) // 2)
        actions = [action for action, possible in ((GROW, size < scenario.max_workers),
                                                   (LEAVE, size > scenario.workers)) if possible]
        action = rng.choice(actions)
        index = rng.randrange(size) if action == LEAVE else 0
        size += 1 if action == GROW else -1
        resizes.append(Resize(step, action, index, size))
    return tuple(resizes)


# A live elastic run's changes: at most this many, this many steps or more apart (and from
# the start and end: each forms one or two generations, and a killed rank's restart takes a
# few seconds of the run's paced steps before it rejoins); a kill is drawn this often.
MAX_LIVE_CHANGES, LIVE_MARGIN_STEPS, KILL_SHARE = 4, 20, 0.25
JOIN, KILL = "join", "kill"


@dataclass(frozen=True)
class LiveChange:
    """A change of a live elastic DDP group, sent from outside once the group trains on the
    size before it and a member has reported step `step`: a `join` (an arrival's launcher
    started with `--join`; its rank takes slot `slot`), a planned `leave` (SIGTERM to slot
    `slot`'s rank, or to its arrival's launcher: `to_launcher`) or a `kill` (SIGKILL to
    slot `slot`'s rank: the others re-form without it, its launcher starts it again and it
    rejoins). `size`: the group's members once the change is done."""

    step: int
    action: str
    slot: int
    size: int
    to_launcher: bool = False

    @property
    def before(self) -> int:
        """The members of the group the change is sent to."""
        return {JOIN: self.size - 1, LEAVE: self.size + 1}.get(self.action, self.size)

    @property
    def sizes(self) -> list[int]:
        """The sizes the group trains at after the change, in order (a kill: without the
        rank, then with it again)."""
        return [self.size - 1, self.size] if self.action == KILL else [self.size]

    def describe(self) -> str:
        what = {JOIN: f"an arrival started with --join, slot {self.slot} (grow)",
                LEAVE: (f"SIGTERM to the launcher of arrival slot {self.slot}" if self.to_launcher
                        else f"SIGTERM to rank {self.slot}") + " (planned leave)",
                KILL: f"SIGKILL to rank {self.slot} (live recovery)"}[self.action]
        sizes = f"{self.before} to {self.size - 1} ranks and back" if self.action == KILL else \
            f"{self.before} to {self.size} ranks"
        return f"resize at step {self.step}: {what}, {sizes} (from outside)"


def live_sizes(first: int, changes: tuple[LiveChange, ...]) -> list[int]:
    """The sizes a live run of `first` ranks trains at through `changes`, in order, as the
    summary's `live_world_sizes` lists them."""
    sizes = [first]
    for change in changes:
        sizes += change.sizes
    return sizes


def draw_live_changes(scenario: Scenario, rng: random.Random) -> tuple[LiveChange, ...]:
    """One to `MAX_LIVE_CHANGES` changes of a live elastic `scenario` at increasing steps,
    each `LIVE_MARGIN_STEPS` or more from the start, the end and the one before. Each is a
    join (below MAX), a planned leave of a member (above MIN: leaves alone never take the
    group below MIN) or, `KILL_SHARE` of the time, a member's death (the group may dip
    below MIN until it rejoins), within each slot's restart budget. A leave never takes
    the last of the first launcher's ranks (were they all gone, it would end, and the store
    the arrivals reach with it; and the summary is written by the last group's leader, its
    lowest slot). Arrivals take the slots after the first ones, in order (never reused)."""
    margin, last = LIVE_MARGIN_STEPS, scenario.total_steps - LIVE_MARGIN_STEPS
    members, arrivals, kills = list(range(scenario.workers)), scenario.workers, dict[int, int]()
    changes: list[LiveChange] = []
    step = 0
    for _ in range(rng.randint(1, MAX_LIVE_CHANGES)):
        if step + margin > last:
            break
        step = rng.randint(step + margin, step + margin + (last - step - margin) // 2)
        first = [slot for slot in members if slot < scenario.workers]
        movable = [slot for slot in members if slot >= scenario.workers or len(first) > 1]
        killable = [slot for slot in members if kills.get(slot, 0) < scenario.max_restarts - 1]
        actions = [action for action, possible in ((JOIN, len(members) < scenario.max_workers),
                                                   (LEAVE, len(members) > scenario.workers))
                   if possible]
        if killable and (not actions or rng.random() < KILL_SHARE):
            slot = rng.choice(killable)
            kills[slot] = kills.get(slot, 0) + 1
            changes.append(LiveChange(step, KILL, slot, len(members)))
        elif rng.choice(actions) == JOIN:
            members.append(arrivals)
            changes.append(LiveChange(step, JOIN, arrivals, len(members)))
            arrivals += 1
        else:
            slot = rng.choice(movable)
            members.remove(slot)
            launched = slot >= scenario.workers and rng.random() < 0.5
            changes.append(LiveChange(step, LEAVE, slot, len(members), to_launcher=launched))
    return tuple(changes)
