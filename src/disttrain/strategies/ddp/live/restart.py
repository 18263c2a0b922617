"""Starting a live group again when every member has died while the launcher lives: the
ranks waiting to join form the next generation themselves, from the run's newest
checkpoint.

A restarted rank asks to join (a ticket, see `group`) and waits for the group's leader
to admit it. When every member of the newest generation has died (the launcher counted
each one's death past the attempt it joined with, see `forming`), no leader is left to
admit anyone, nor will one come: a generation's members are only ever fixed by live
members of the one before. So each waiting rank watches for that (`restart_if_gone`),
and then the waiting ranks fix the next generation themselves: each offers a decision
(`Restart`: each slot's newest ticket whose process lives, and the ticket count it
covers) by compare-and-set on `gen<g>/restart`; the first offer wins, and every waiting
rank carries it out (the members' attempts, the member list, the admissions: the same
values whoever writes them), so it completes even when the rank that offered it dies.
A ticket taken after the decision's count is admitted later by the new group as usual.

Nobody in such a generation holds the run's state (`membership.choose_source`): its
leader reads the newest good checkpoint (none yet: the run starts again) and hands it to
the others, as a `--resume` start does, so the steps since that checkpoint are trained
again and counted once (the ledger is in the checkpoint). The tickets the group has
taken care of are the store's (`admitted_so_far`), not the checkpoint's count: tickets
admitted since it was written must not be admitted again, and a `--resume` starts with a
store where none was taken.

Two groups never run at once: generation g+1 is fixed once (compare-and-set), by live
members of g (re-forming, growing) or, once all of them are dead, by the waiting ranks;
a dead process writes nothing more. A rank that comes back after the run finished finds
it done (`group.DONE_KEY`) and stops.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

from disttrain.strategies.ddp.live.forming import attempt_key, deaths_key
from disttrain.strategies.ddp.live.membership import (
    Ticket,
    all_dead,
    format_members,
    parse_members,
    restart_tickets,
)

JOINS_KEY = "joins"  # the count of tickets taken
POLL_S = 0.05


def ticket_key(number: int) -> str:
    """Ticket `number`'s slot (written after its attempt, `ticket_attempt_key`)."""
    return f"join/{number}"


def ticket_attempt_key(number: int) -> str:
    return f"join/{number}/attempt"


def admit_key(number: int) -> str:
    """The generation ticket `number` was admitted to."""
    return f"admit/{number}"


def members_key(generation: int) -> str:
    return f"gen{generation}/members"


def restart_key(generation: int) -> str:
    return f"gen{generation}/restart"


@dataclass(frozen=True)
class Restart:
    """A generation fixed by waiting ranks: the tickets it admits (its members) and the
    count of tickets taken when it was decided (each one up to it is taken care of)."""

    generation: int
    covered: int
    tickets: tuple[Ticket, ...]

    @property
    def members(self) -> tuple[int, ...]:
        return parse_members(format_members(t.slot for t in self.tickets))

    def encode(self) -> str:
        return json.dumps({"covered": self.covered,
                           "tickets": [[t.number, t.slot, t.attempt] for t in self.tickets]})

    @classmethod
    def decode(cls, generation: int, text: str | bytes) -> Restart:
        fields = json.loads(text)
        return cls(generation, int(fields["covered"]),
                   tuple(Ticket(int(n), int(slot), int(attempt)) for n, slot, attempt in fields["tickets"]))


def newest_generation(store: dist.Store, known: int) -> int:
    """The newest generation whose members are fixed, from `known` on (generation 0's are
    the run's slots, fixed from the start, with no key)."""
    generation = max(known, 0)
    while store.check([members_key(generation + 1)]):
        generation += 1
    return generation


def member_attempts(store: dist.Store, generation: int, first_members: Iterable[int]) -> dict[int, int]:
    """Each member of `generation` and the attempt it joined with (written before the
    member list, whoever fixed it)."""
    if generation == 0:
        return {slot: 0 for slot in first_members}
    members = parse_members(store.get(members_key(generation)).decode())
    return {slot: int(store.get(attempt_key(generation, slot)).decode()) for slot in members}


def death_counts(store: dist.Store, slots: Iterable[int]) -> dict[int, int]:
    return {slot: int(store.add(deaths_key(slot), 0)) for slot in set(slots)}


def restart_if_gone(store: dist.Store, known: int, first_members: Iterable[int], ticket_wait_s: float,
                    clock: Callable[[], float] = time.monotonic) -> tuple[int, Restart | None]:
    """Fix the next generation with the waiting ranks when every member of the newest one
    has died (call while waiting to be admitted; then look for this process's admission).

    Args:
        known: the newest generation the caller saw before (where the search starts).
        first_members: generation 0's members (the run's slots).
        ticket_wait_s: how long a ticket whose number is taken but whose slot is not yet
            written is waited for (its process died, or stalled, in between: left out).
    Returns:
        The newest generation now fixed, and the restart carried out (None: a member of
        the newest generation lives, or it changed meanwhile).
    """
    newest = newest_generation(store, known)
    attempts = member_attempts(store, newest, first_members)
    if not attempts or not all_dead(attempts, death_counts(store, attempts)):
        return newest, None
    generation = newest + 1
    # Fixed by a member before it died (read after its death: a dead process writes no more).
    if store.check([members_key(generation)]):
        return newest, None
    if store.check([restart_key(generation)]):
        decided = store.get(restart_key(generation))
    else:
        decided = store.compare_set(restart_key(generation), "", offer(store, generation, ticket_wait_s,
                                                                        clock).encode())
    restart = Restart.decode(generation, decided)
    carry_out(store, restart)
    return generation, restart


def offer(store: dist.Store, generation: int, ticket_wait_s: float,
          clock: Callable[[], float] = time.monotonic) -> Restart:
    """This process's offer for `generation`: the tickets `restart_tickets` chooses of all
    taken so far."""
    covered = int(store.add(JOINS_KEY, 0))
    tickets, admitted = [], set()
    for number in range(1, covered + 1):
        ticket = read_ticket(store, number, ticket_wait_s, clock)
        if ticket is not None:
            tickets.append(ticket)
        if store.check([admit_key(number)]):
            admitted.add(number)
    chosen = restart_tickets(tickets, admitted, death_counts(store, (t.slot for t in tickets)))
    return Restart(generation, covered, chosen)


def read_ticket(store: dist.Store, number: int, wait_s: float,
                clock: Callable[[], float] = time.monotonic) -> Ticket | None:
    """Ticket `number` (its process writes its slot just after taking it), or None when it
    is not written within `wait_s`."""
    deadline = clock() + wait_s
    while not store.check([ticket_key(number)]):
        if clock() >= deadline:
            return None
        time.sleep(POLL_S)
    return Ticket(number, int(store.get(ticket_key(number)).decode()),
                  int(store.get(ticket_attempt_key(number)).decode()))


def carry_out(store: dist.Store, restart: Restart) -> None:
    """Write what `restart` decided (the same values whoever writes them): the members'
    attempts before the member list (whoever reads the list finds them), then each
    ticket's admission."""
    for ticket in restart.tickets:
        store.set(attempt_key(restart.generation, ticket.slot), str(ticket.attempt))
    store.compare_set(members_key(restart.generation), "", format_members(restart.members))
    for ticket in restart.tickets:
        store.set(admit_key(ticket.number), str(restart.generation))


def admitted_so_far(store: dist.Store, generation: int) -> int:
    """The tickets a group that takes the run's state from a checkpoint has taken care of,
    at `generation`: those covered by the newest restart up to it, or up to the newest
    ticket admitted, whichever is further (0 in a store where none was taken)."""
    covered = 0
    for earlier in range(generation, 0, -1):
        if store.check([restart_key(earlier)]):
            covered = Restart.decode(earlier, store.get(restart_key(earlier))).covered
            break
    count = int(store.add(JOINS_KEY, 0))
    admitted = [number for number in range(covered + 1, count + 1) if store.check([admit_key(number)])]
    return max([covered, *admitted])
