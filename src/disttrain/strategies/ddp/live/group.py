"""A live DDP rank's process group, one generation at a time, agreed through a store.

The launcher hosts a TCP store that outlives every rank. Through it the ranks:

- beat: each process writes the wall time under `alive/<slot>` every heartbeat interval
  (a thread with its own connection, started once it is a member), so its peers tell a
  dead member from a slow one; the launcher writes 0 there when it sees the process exit,
  so the survivors need not wait for its beats to go stale;
- re-form after a failure: a survivor of generation g proposes itself for g+1
  (`gen<g+1>/propose/<slot>`), waits until `membership.settled` (every member of g has
  proposed or gone silent, bounded by a window), and offers the member list with
  compare-and-set on `gen<g+1>/members`; the first offer wins and everyone reads it, so
  they all agree. A survivor left out of the list joins again like a restarted rank;
- take a rank back: a joiner takes a ticket (`joins` counter, `join/<n>` = its slot) and
  waits for `admit/<n>`; the group's leader reads the counter at each step boundary and
  broadcasts it, the members then form g+1 with the joiners, and the leader admits them.
  When every member of the newest generation has died, the waiting ranks fix the next
  one themselves (`restart`), and it goes on from the run's newest checkpoint.
- let a member go: at each step boundary the members gather the leader's ticket count
  and whether each was SIGTERMed (`pending_changes`); the members that stay form g+1
  without the leavers (and with any joiners), offered by the lowest of them, while the
  leavers drop the group and exit. Nobody waits for a death to be detected.

Each generation's process group lives under its own prefix (`gen<g>/pg`), so a new group
never reads a dead one's addresses.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any group exists, and for that reason only: its functions take the
# default process group as a default argument (`group=group.WORLD`), evaluated when the
# module is first imported. The DDP module imports it as it wraps a model, where nothing
# did before (in torch 2.13 `torch._dynamo` does, which the optimizer's first use imports).
# Imported while a generation's group exists, it would hold that group for the life of
# the process, its sockets open, and a peer blocked in a collective with this process
# would wait out `ddp.timeout_s` instead of failing at once (measured with two processes
# and DDP: 20.0 s against 0.0 s).
import torch.distributed.nn  # noqa: F401  # isort: skip
from torch.distributed import distributed_c10d

from disttrain.core.errors import DistributedError
from disttrain.strategies.ddp.live.forming import CONNECT_S, WatchedStore, arrive, attempt_key, deaths_key
from disttrain.strategies.ddp.live.membership import (
    Change,
    Patience,
    after_leave,
    format_members,
    group_rank,
    next_members,
    parse_members,
    settled,
)
from disttrain.strategies.ddp.live.restart import (
    JOINS_KEY,
    admit_key,
    admitted_so_far,
    members_key,
    restart_if_gone,
    ticket_attempt_key,
    ticket_key,
)

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a settling survivor or a waiting joiner looks at the store again
RELEASE_WAIT_S = 2.0  # the longest `leave` waits for a collective's callbacks to let a group go
RELEASE_POLL_S = 0.001
RELEASE_COLLECT_S = 0.1  # held this long, a group is looked for in reference cycles (`release`)
DONE_KEY = "done"


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the launcher's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def alive_key(slot: int) -> str:
    return f"alive/{slot}"


def mark_dead(store: dist.Store, slot: int) -> None:
    """The process of `slot` exited: its peers count it silent at once, and members forming
    a generation with it stop waiting for it (the launcher calls this; a new process of the
    slot beats again once it is a member, see `forming`)."""
    store.set(alive_key(slot), "0")
    store.add(deaths_key(slot), 1)


class Beats:
    """The liveness beats of one process, on a thread with its own store connection."""

    def __init__(self, store: dist.TCPStore, slot: int, interval_s: float,
                 clock: Callable[[], float] = time.time):
        self.store, self.slot, self.interval_s, self.clock = store, slot, interval_s, clock
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-beats", daemon=True)

    def start(self) -> None:
        """Beat now and every interval after (once; later calls do nothing)."""
        if self._thread.ident is not None or self._stopped.is_set():
            return
        self.store.set(alive_key(self.slot), repr(self.clock()))
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.store.set(alive_key(self.slot), repr(self.clock()))
            except RuntimeError:  # the launcher (and its store) went away: the run is over
                return

    def stop(self) -> None:
        self._stopped.set()


def release(groups: list[dist.ProcessGroup], wait_s: float) -> None:
    """Free each of `groups` (process groups no longer registered with torch) on this thread
    once nothing else holds it, waiting up to `wait_s` for the holders to let go; a group
    still held then stays in `groups` for the next call, and a warning names its holders.

    Why it matters: a group's sockets close only when it is freed. A group destroyed but
    still held keeps its connections open, so a peer blocked in a collective with this
    process waits out the whole collective timeout (`ddp.timeout_s`) instead of failing at
    once (measured: two processes, the one blocked in an all-reduce failed after 0.0 s when
    the other freed its group, after the full 20 s timeout when it destroyed it but kept a
    reference; the backend's `abort` and `shutdown` close nothing in torch 2.13). In a live
    group of three or more, that is a survivor waiting on another survivor that has already
    moved on to re-form.

    Two kinds of holder. A collective's future runs its callbacks on one of gloo's worker
    threads, and a callback that captured the group (PyTorch's PowerSGD hook does) drops
    its reference there, just after the future the main thread waits on is complete. Were
    that the last reference, the group's destructor would run on that worker thread and
    join every worker thread, itself included, and the process aborts ("Resource deadlock
    avoided"): holding the group until the callbacks are gone makes this thread the one
    that frees it. And a reference cycle, which only the collector frees: a failed
    collective's error kept in a variable of a frame of its own traceback (that frame, or
    one below it, holds the group), so a group still held after `RELEASE_COLLECT_S` is
    looked for by one collection, on this thread.
    """
    started = time.monotonic()
    collected = False
    while True:
        for index in reversed(range(len(groups))):
            if sys.getrefcount(groups[index]) <= 2:  # the list's reference and the argument's
                del groups[index]  # the last reference: the group is freed here
        waited = time.monotonic() - started
        if not groups:
            return
        if not collected and waited >= min(RELEASE_COLLECT_S, wait_s):
            gc.collect()  # frees the cycles holding a group; their last reference goes here
            collected = True
            continue
        if waited >= wait_s:
            holders = sorted({type(r).__name__ for r in gc.get_referrers(*groups) if r is not groups})
            logger.warning("a past generation's process group is still held after %.1f s (by %s): its "
                           "sockets stay open, so a peer blocked in a collective with this process "
                           "waits until its timeout", wait_s, ", ".join(holders) or "nothing Python sees")
            return
        time.sleep(RELEASE_POLL_S)


class LiveGroup:
    """This process's place in the live group (`slot`), and the group of the current
    generation once formed.

    Args:
        store: the launcher's store.
        slot: this process's rank in the run as started (0 to N-1).
        patience: how long it waits on the members (collectives, silence, re-forming).
        attempt: how often the launcher started this slot before (`forming`).
        first_members: generation 0's members, the run's slots (a waiting rank reads them
            to tell whether any member is left to admit it; `restart`).
    """

    def __init__(self, store: dist.TCPStore, slot: int, patience: Patience,
                 clock: Callable[[], float] = time.time, attempt: int = 0,
                 first_members: tuple[int, ...] = ()):
        self.store, self.slot, self.patience = store, slot, patience
        self.timeout_s, self.stale_s, self.clock = patience.timeout_s, patience.stale_s, clock
        self.attempt, self.first_members = attempt, first_members
        self.newest = 0  # the newest generation this process saw fixed (while waiting to join)
        self.generation = -1
        self.members: tuple[int, ...] = ()
        self.attempts: dict[int, int] = {}  # each member's attempt, in this generation
        self._left: list[dist.ProcessGroup] = []  # groups of past generations not yet freed
        self.leave_requested = False  # SIGTERMed: leave at the next step boundary (set by a handler)

    @property
    def rank(self) -> int:
        return group_rank(self.members, self.slot)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def form(self, generation: int, members: tuple[int, ...]) -> None:
        """Start generation `generation`'s process group (a collective of `members`).

        Raises:
            MemberLost: a member died meanwhile (the launcher marked it; see `forming`).
            RuntimeError, dist.DistError: a member did not come within the timeout.
        """
        self.leave()
        self.generation, self.members = generation, members
        self.attempts = {slot: self._attempt_of(generation, slot) for slot in members}
        store = self.watched(dist.PrefixStore(f"gen{generation}/pg", self.store))
        arrive(store, self.slot, self.attempts)
        try:
            # Made with the short connect bound (see `forming`), then given ddp.timeout_s.
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=len(members),
                                    timeout=timedelta(seconds=min(CONNECT_S, self.timeout_s)))
        except BaseException:
            # A failed start leaves torch's count of groups advanced (destroying a group
            # resets it), and the next generation would then meet under another name
            # than its peers'.
            distributed_c10d._world.group_count = 0
            raise
        distributed_c10d._set_pg_timeout(timedelta(seconds=self.timeout_s))
        logger.info("slot %d is rank %d of generation %d (members %s)", self.slot, self.rank, generation,
                    format_members(members))

    def watched(self, store: dist.Store) -> WatchedStore:
        """`store`, its waits cut short when a member of this generation dies."""
        return WatchedStore(store, self.lost_member, self.timeout_s)

    def lost_member(self) -> str | None:
        """Which member of this generation the launcher saw die, if one did (None)."""
        for slot, attempt in self.attempts.items():
            if slot != self.slot and self.store.add(deaths_key(slot), 0) > attempt:
                return f"slot {slot} died while generation {self.generation} formed"
        return None

    def _attempt_of(self, generation: int, slot: int) -> int:
        """`slot`'s attempt in `generation` as recorded (generation 0: every first start)."""
        if generation == 0:
            return 0
        if slot == self.slot:
            return self.attempt
        return int(self.store.get(attempt_key(generation, slot)).decode())

    def leave(self) -> None:
        """Drop this generation's process group (its sockets close, so peers blocked in a
        collective with this process fail at once instead of at the timeout), freed on
        this thread (`release`)."""
        if dist.is_initialized():
            self._left.append(distributed_c10d._get_default_group())
            dist.destroy_process_group()
        release(self._left, RELEASE_WAIT_S)

    def after_failure(self) -> tuple[int, tuple[int, ...]] | None:
        """Agree with the survivors on the next generation: (generation, members), or None
        when this process was left out of it (it then joins like a restarted rank)."""
        self.leave()
        generation, previous = self.generation + 1, self.members
        prefix = f"gen{generation}"
        self.store.set(attempt_key(generation, self.slot), str(self.attempt))  # before proposing
        self.store.set(f"{prefix}/propose/{self.slot}", "1")
        started = self.clock()
        key = members_key(generation)
        while not self.store.check([key]):
            proposed = [s for s in previous if self.store.check([f"{prefix}/propose/{s}"])]
            if settled(self.clock(), started, previous, proposed, self._last_seen(previous), self.patience):
                offer = format_members(next_members(previous, proposed))
                self.store.compare_set(key, "", offer)
                break
            time.sleep(POLL_S)
        members = parse_members(self.store.get(key).decode())
        if self.slot not in members:
            logger.warning("slot %d was left out of generation %d (members %s); it joins again",
                           self.slot, generation, format_members(members))
            return None
        return generation, members

    def _last_seen(self, slots: tuple[int, ...]) -> dict[int, float]:
        seen = {}
        for slot in slots:
            key = alive_key(slot)
            if self.store.check([key]):
                seen[slot] = float(self.store.get(key).decode())
        return seen

    def pending_joins(self, admitted: int) -> int:
        """The join tickets taken so far, as the leader read them (a collective: every
        member gets the same count, so all take the joiners at the same step)."""
        count = torch.tensor([self.store.add(JOINS_KEY, 0) if self.is_leader else 0], dtype=torch.int64)
        dist.broadcast(count, src=0)
        return max(int(count.item()), admitted)

    def pending_changes(self, admitted: int, leaving: bool, wait_s: float = 0.0) -> Change:
        """What changes at this step boundary (a collective: every member gets the same):
        the join tickets taken so far as the leader read them, and the slots that leave
        (each member says whether it was SIGTERMed).

        Args:
            admitted: the tickets taken care of.
            leaving: this member leaves at this boundary.
            wait_s: the leader first waits up to this long for a new ticket (a group below
                its minimum waiting for arrivals; the others wait in the collective).
        """
        if self.is_leader and wait_s > 0:
            deadline = self.clock() + wait_s
            while self.store.add(JOINS_KEY, 0) <= admitted and self.clock() < deadline:
                time.sleep(POLL_S)
        mine = torch.tensor([self.store.add(JOINS_KEY, 0) if self.is_leader else 0, int(leaving)],
                            dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        leavers = tuple(slot for slot, said in zip(sorted(self.members), gathered, strict=True) if said[1])
        return Change(max(int(gathered[0][0]), admitted), leavers)

    def grow(self, admitted: int, tickets: int) -> tuple[int, tuple[int, ...]] | None:
        """`change` with joiners only."""
        return self.change(admitted, tickets)

    def change(self, admitted: int, tickets: int, leavers: tuple[int, ...] = ()
               ) -> tuple[int, tuple[int, ...]] | None:
        """The next generation: the members that stay (all but `leavers`, who leave at this
        boundary and must not call this) with the joiners of tickets `admitted+1 ..
        tickets`. The lowest member that stays offers it (compare-and-set) and admits the
        joiners; the others read it. None when that member went silent before offering it
        (the caller then re-forms as after a failure) or the list leaves this process out."""
        self.leave()
        generation = self.generation + 1
        key = members_key(generation)
        staying = after_leave(self.members, leavers)
        assert self.slot in staying, "a member that leaves does not form the next generation"
        leader = staying[0]
        if self.slot == leader:
            attempts = {slot: attempt for slot, attempt in self.attempts.items() if slot in staying}
            for n in range(admitted + 1, tickets + 1):
                joiner = int(self.store.get(ticket_key(n)).decode())
                attempts[joiner] = int(self.store.get(ticket_attempt_key(n)).decode())
            for slot, attempt in attempts.items():  # before the members: whoever reads those finds these
                self.store.set(attempt_key(generation, slot), str(attempt))
            self.store.compare_set(key, "", format_members(attempts))
            for n in range(admitted + 1, tickets + 1):
                self.store.set(admit_key(n), str(generation))
        while not self.store.check([key]):
            if self.clock() - self._last_seen((leader,)).get(leader, float("-inf")) >= self.stale_s:
                return None
            time.sleep(POLL_S)
        members = parse_members(self.store.get(key).decode())
        return (generation, members) if self.slot in members else None

    def request_join(self) -> tuple[int, tuple[int, ...]] | None:
        """Take a ticket and wait to be admitted, by the group's leader or, when every
        member of the newest generation has died, by the waiting ranks themselves
        (`restart`): (generation, members), or None when the run ended meanwhile.

        A SIGTERM meanwhile (`leave_requested`) returns None too: the process leaves (were
        its ticket admitted meanwhile, the launcher marks its exit, and the forming group
        goes on without it, see `forming`).

        Raises:
            DistributedError: not admitted within the timeout.
        """
        ticket = self.store.add(JOINS_KEY, 1)
        self.store.set(ticket_attempt_key(ticket), str(self.attempt))  # before the slot the leader reads
        self.store.set(ticket_key(ticket), str(self.slot))
        logger.info("slot %d asks to join the running group (ticket %d)", self.slot, ticket)
        deadline = self.clock() + self.timeout_s
        admitted = admit_key(ticket)
        while not self.store.check([admitted]):
            if self.store.check([DONE_KEY]) or self.leave_requested:
                return None
            self._restart_if_gone()
            if self.store.check([admitted]):
                break
            if self.clock() > deadline:
                raise DistributedError(f"slot {self.slot} was not taken back into the group within "
                                       f"{self.timeout_s:g}s (ddp.timeout_s)")
            time.sleep(POLL_S)
        generation = int(self.store.get(admitted).decode())
        return generation, parse_members(self.store.get(members_key(generation)).decode())

    def _restart_if_gone(self) -> None:
        self.newest, restart = restart_if_gone(self.store, self.newest, self.first_members, self.stale_s)
        if restart is not None:
            logger.warning("slot %d: every member of generation %d died; the ranks waiting to join start "
                           "generation %d (members %s) from the run's newest checkpoint", self.slot,
                           restart.generation - 1, restart.generation, format_members(restart.members))

    def previous_members(self) -> tuple[int, ...]:
        """The members of the generation before this one (none before generation 0)."""
        before = self.generation - 1
        if before < 0:
            return ()
        if before == 0:
            return self.first_members
        return parse_members(self.store.get(members_key(before)).decode())

    def admitted_so_far(self) -> int:
        """The join tickets taken care of, as the store says (for a state read from a
        checkpoint, whose own count may be behind, or of another run's store)."""
        return admitted_so_far(self.store, self.generation)

    def finish(self) -> None:
        """The run is over: a rank still waiting to join leaves."""
        self.store.set(DONE_KEY, "1")
