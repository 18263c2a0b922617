"""The pure rules of live recovery: when the survivors of a generation have all spoken,
who the next generation's members are, how a global batch splits over them, whose
state they all take, and, when every member of a generation has died, which waiting
ranks start the next one from the run's newest checkpoint.

A *generation* is one process group. Its members are *slots* (the ranks the run was
started with, 0 to N-1, each kept by one process at a time); a member's rank in the
group is its place among the sorted members, so the lowest slot leads. Nothing here
touches a store, a socket or a clock: the I/O shell (`group`) reads them and passes
them in, so tests step time by hand.

An elastic run (`--world-size MIN:MAX`) adds: the slots of ranks started by hand or as
hot spares (`arrival_slot`), the place a rank holds or takes up to MAX (`place_to_take`: an
arrival takes room to grow or a lost member's place, a spare only the latter; one that
finds none waits as a spare, and `stepped_in` names the spares a change took
in), the members that stay when some leave at a step boundary (`Change`, `after_leave`),
the minimum (`below_minimum`), and the line and the list of sizes a change of size
leaves (`size_change`, `world_sizes`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass


def format_members(members: Iterable[int]) -> str:
    """`0,2,3`: how a member list is written in the store."""
    return ",".join(str(slot) for slot in sorted(set(members)))


def parse_members(text: str) -> tuple[int, ...]:
    """The member list `format_members` wrote.

    Raises:
        ValueError: not a comma-separated list of slots.
    """
    return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))


@dataclass(frozen=True)
class Patience:
    """How long the live group waits on its members.

    Attributes:
        stale_s: a member silent this long counts as dead.
        window_s: the longest survivors wait for each other before re-forming.
        timeout_s: bound of every collective and of forming a group (`ddp.timeout_s`).
    """

    stale_s: float
    window_s: float
    timeout_s: float


def settled(now: float, started: float, previous: Sequence[int], proposed: Iterable[int],
            last_seen: Mapping[int, float], patience: Patience) -> bool:
    """Whether the survivors of a failed generation may fix the next one's members.

    Every member of the previous generation has either proposed itself for the next one,
    or has been silent (no liveness beat) for `patience.stale_s` and counts as dead. After
    `patience.window_s` from `started` the survivors go on with whoever proposed by then
    (a member alive but stuck is left out; it joins again later).

    Args:
        now, started: the clock now and when this survivor began to settle.
        previous: the members of the generation that failed.
        proposed: the slots that proposed themselves for the next generation.
        last_seen: each slot's latest liveness beat (absent: never seen).
    """
    stale_s, window_s = patience.stale_s, patience.window_s
    if now - started >= window_s:
        return True
    proposed = set(proposed)
    return all(slot in proposed or now - last_seen.get(slot, float("-inf")) >= stale_s
               for slot in previous)


def next_members(previous: Sequence[int], proposed: Iterable[int],
                 joiners: Iterable[int] = ()) -> tuple[int, ...]:
    """The next generation: the previous members that proposed themselves, and the joiners.

    Raises:
        ValueError: nobody is left.
    """
    members = ({slot for slot in proposed if slot in set(previous)}) | set(joiners)
    if not members:
        raise ValueError("no member is left to form the next generation")
    return tuple(sorted(members))


def group_rank(members: Sequence[int], slot: int) -> int:
    """`slot`'s rank in the group of `members` (its place among them, sorted).

    Raises:
        ValueError: `slot` is not a member.
    """
    ordered = sorted(members)
    if slot not in ordered:
        raise ValueError(f"slot {slot} is not among the members {ordered}")
    return ordered.index(slot)


def split_batch(global_batch: int, num_ranks: int) -> tuple[int, ...]:
    """Each rank's piece of a global batch, as even as it goes (the first ones one larger).

    Raises:
        ValueError: fewer samples than ranks, or no ranks.
    """
    if num_ranks < 1 or global_batch < num_ranks:
        raise ValueError(f"a global batch of {global_batch} cannot be split over {num_ranks} ranks")
    base, extra = divmod(global_batch, num_ranks)
    return tuple(base + (1 if rank < extra else 0) for rank in range(num_ranks))


@dataclass(frozen=True)
class Holding:
    """What one member of a new generation brings: whether it holds training state (a
    joiner does not) and how far that state is (steps applied, evaluations made)."""

    has_state: bool
    step: int = 0
    evaluations: int = 0


def choose_source(holdings: Sequence[Holding]) -> int | None:
    """The group rank every member takes its state from: the furthest holder (a survivor
    that finished the failed step's all-reduce has applied it; its peers that did not
    take its state, so the step is neither lost nor applied twice), the lowest on a tie.

    Returns:
        None when no member holds state: every holder died (the group was restarted by
        the ranks waiting to join, or its only holder died before handing its state
        over), and the group goes on from the run's newest checkpoint, which its leader
        reads and hands to the others.
    """
    holders = [(h.step, h.evaluations, -rank) for rank, h in enumerate(holdings) if h.has_state]
    if not holders:
        return None
    return -max(holders)[2]


@dataclass(frozen=True)
class Ticket:
    """A request to join the running group: its number (the store's `joins` count), and
    the slot and attempt of the process that took it."""

    number: int
    slot: int
    attempt: int


def is_dead(attempt: int, deaths: int) -> bool:
    """Whether the process of a slot started for the `attempt`-th time (from 0) has died:
    the launcher counted more deaths of its slot (restarts follow deaths one for one, see
    `forming`)."""
    return deaths > attempt


def all_dead(attempts: Mapping[int, int], deaths: Mapping[int, int]) -> bool:
    """Whether every member of a generation (slot -> the attempt it joined with) has died,
    by the launcher's count of each slot's deaths: nobody is left to take a waiting rank
    back, nor will be."""
    return all(is_dead(attempt, deaths.get(slot, 0)) for slot, attempt in attempts.items())


def restart_tickets(tickets: Iterable[Ticket], admitted: Collection[int],
                    deaths: Mapping[int, int]) -> tuple[Ticket, ...]:
    """Whom a generation started by waiting ranks takes, once every member of the newest
    one has died: each slot's newest ticket, unless it was admitted already (that process
    went into a group, and is a member of it or dead) or its process has died.

    Args:
        tickets: the tickets taken so far (each one's slot and attempt known).
        admitted: the numbers of the tickets admitted to some generation.
        deaths: each slot's death count (the launcher's).
    Returns:
        The chosen tickets by number (one per slot).
    """
    newest: dict[int, Ticket] = {}
    for ticket in sorted(tickets, key=lambda t: t.number):
        newest[ticket.slot] = ticket
    return tuple(ticket for ticket in sorted(newest.values(), key=lambda t: t.number)
                 if ticket.number not in admitted and not is_dead(ticket.attempt, deaths.get(ticket.slot, 0)))


# Elastic runs (`--world-size MIN:MAX`): ranks arrive by hand and leave on SIGTERM.


def arrival_slot(num_workers: int, arrival: int) -> int:
    """The slot of the `arrival`-th rank (from 1) started by hand into a running elastic
    run: the slots after the run's first `num_workers`, one per arrival, never reused (a
    slot's death count tells its processes apart, see `forming`).

    Raises:
        ValueError: `arrival` is not 1 or more.
    """
    if arrival < 1:
        raise ValueError(f"arrivals are counted from 1, not {arrival}")
    return num_workers + arrival - 1


OPEN = ""  # a place never taken: the room an elastic run has to grow (arrivals take it)
FREED = "-"  # a place a lost member held: a spare takes it, or an arrival


def place_to_take(holders: Sequence[str], slot: int, spare: bool) -> int | None:
    """The place `slot` holds or takes, by index: the one naming it already, else the first
    freed one, or for an arrival (not a spare) the first open or freed one; None when there
    is none (it waits as a spare). A spare restores the group's size after a loss: it never
    takes an open place, which would grow an elastic run past what it was given.

    Args:
        holders: each place's holder: a slot as text, `OPEN` or `FREED` (`places`).
    """
    holders = list(holders)
    if str(slot) in holders:
        return holders.index(str(slot))
    free = [index for index, holder in enumerate(holders)
            if holder == FREED or (holder == OPEN and not spare)]
    return free[0] if free else None


def stepped_in(before: Sequence[int], after: Sequence[int], spares: Collection[int]) -> tuple[int, ...]:
    """The spares that stepped in at a change of group: the members new in `after` whose
    process took a lost member's place (`spares`: the new members marked so in the store)."""
    return tuple(sorted(slot for slot in set(after) - set(before) if slot in spares))


@dataclass(frozen=True)
class Change:
    """What a step boundary changes in a generation, as every member agreed on it: the
    join tickets taken so far (the leader's count) and the slots leaving (SIGTERMed)."""

    tickets: int
    leavers: tuple[int, ...] = ()

    def changes(self, admitted: int) -> bool:
        """Whether the group must change (joiners wait, or members leave)."""
        return self.tickets > admitted or bool(self.leavers)


def after_leave(members: Sequence[int], leavers: Iterable[int]) -> tuple[int, ...]:
    """The members that stay when `leavers` leave at a step boundary (empty: every member
    left, the run is preempted)."""
    gone = set(leavers)
    return tuple(sorted(slot for slot in members if slot not in gone))


def below_minimum(world_size: int, min_world_size: int) -> bool:
    """Whether a group of `world_size` must wait for arrivals before training (an elastic
    run trains while at least its minimum remain; `min_world_size` 0: no minimum)."""
    return world_size < min_world_size


def size_change(before: Sequence[int], after: Sequence[int], shares: Sequence[int]) -> str:
    """One line saying what a change of group did: `2 -> 3 ranks (slot 2 joined): the
    global batch of 32 split 11,11,10`.

    Args:
        before, after: the members of the two generations.
        shares: each member's piece of the global batch in the new generation (rank order).
    """
    joined = sorted(set(after) - set(before))
    left = sorted(set(before) - set(after))
    what = [f"slot{'s' if len(joined) > 1 else ''} {format_members(joined)} joined"] if joined else []
    what += [f"slot{'s' if len(left) > 1 else ''} {format_members(left)} left"] if left else []
    why = f" ({', '.join(what)})" if what else ""
    return (f"{len(before)} -> {len(after)} ranks{why}: the global batch of {sum(shares)} split "
            f"{','.join(str(share) for share in shares)}")


def world_sizes(first: int, recoveries: Iterable[Mapping[str, object]]) -> list[int]:
    """The sizes a run trained at, in order (a change that kept the size is not repeated):
    its first generation's, then each recovery's members'."""
    sizes = [first]
    for recovery in recoveries:
        members = recovery["members"]
        assert isinstance(members, Collection)
        if len(members) != sizes[-1]:
            sizes.append(len(members))
    return sizes
