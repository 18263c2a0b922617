"""A live group whose members all died while the launcher lives: the ranks waiting to join
tell it from the launcher's death counts, and fix the next generation themselves; the
first offer wins and any waiting rank completes it; tickets admitted, superseded or of
dead processes are left out; a group that still has a live member, or a finished run, is
left alone. The rules are pure; the protocol runs on an in-process store."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from disttrain.strategies.ddp.live.forming import attempt_key
from disttrain.strategies.ddp.live.group import DONE_KEY, LiveGroup, mark_dead
from disttrain.strategies.ddp.live.membership import (
    Holding,
    Patience,
    Ticket,
    all_dead,
    choose_source,
    is_dead,
    restart_tickets,
)
from disttrain.strategies.ddp.live.restart import (
    JOINS_KEY,
    Restart,
    admit_key,
    admitted_so_far,
    members_key,
    offer,
    restart_if_gone,
    restart_key,
    ticket_attempt_key,
    ticket_key,
)

SLOTS = (0, 1, 2)


def take_ticket(store: dist.Store, slot: int, attempt: int) -> int:
    """What a restarted process writes when it asks to join (`LiveGroup.request_join`)."""
    number = store.add(JOINS_KEY, 1)
    store.set(ticket_attempt_key(number), str(attempt))
    store.set(ticket_key(number), str(slot))
    return number


def kill_all(store: dist.Store, slots=SLOTS) -> None:
    for slot in slots:
        mark_dead(store, slot)


def test_a_process_is_dead_once_its_slot_died_more_often_than_its_attempt():
    assert not is_dead(attempt=1, deaths=1)  # the slot's second process, alive
    assert is_dead(attempt=1, deaths=2)
    assert all_dead({0: 0, 2: 1}, {0: 1, 2: 2})
    assert not all_dead({0: 0, 2: 1}, {0: 1, 2: 1})  # slot 2's second process lives
    assert not all_dead({0: 0}, {})  # never died


def test_a_restart_takes_each_slots_newest_ticket_unless_admitted_or_dead():
    tickets = [Ticket(1, 0, 0), Ticket(2, 1, 1), Ticket(3, 0, 1), Ticket(4, 2, 1), Ticket(5, 1, 1),
               Ticket(6, 3, 1)]
    # Slot 0: ticket 3 supersedes 1. Slot 1: its newest (5) was admitted (the process went
    # into a group): its older ticket 2 is not taken. Slot 2's process died again. Slot 3 lives.
    chosen = restart_tickets(tickets, admitted={5}, deaths={0: 1, 1: 1, 2: 2, 3: 1})
    assert chosen == (Ticket(3, 0, 1), Ticket(6, 3, 1))
    assert restart_tickets([], admitted=(), deaths={}) == ()


def test_with_no_holder_the_state_comes_from_the_checkpoint():
    assert choose_source([Holding(False), Holding(False)]) is None
    assert choose_source([Holding(False), Holding(True, 3)]) == 1


def test_a_decision_round_trips_through_the_store_text():
    restart = Restart(4, 7, (Ticket(6, 2, 1), Ticket(7, 0, 3)))
    assert Restart.decode(4, restart.encode()) == restart
    assert restart.members == (0, 2)


def test_a_group_with_a_live_member_is_left_alone():
    store = dist.HashStore()
    mark_dead(store, 0)
    number = take_ticket(store, 0, 1)
    assert restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1) == (0, None)
    mark_dead(store, 1)  # slot 2 still lives
    assert restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1) == (0, None)
    assert not store.check([admit_key(number)]) and not store.check([restart_key(1)])


def test_when_every_member_died_the_waiting_ranks_fix_the_next_generation():
    store = dist.HashStore()
    kill_all(store)
    first, second = take_ticket(store, 1, 1), take_ticket(store, 0, 1)
    newest, restart = restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1)
    assert newest == 1 and restart == Restart(1, 2, (Ticket(first, 1, 1), Ticket(second, 0, 1)))
    assert store.get(members_key(1)) == b"0,1"
    assert [store.get(attempt_key(1, slot)) for slot in (0, 1)] == [b"1", b"1"]
    assert store.get(admit_key(first)) == store.get(admit_key(second)) == b"1"
    # Its members live: nobody fixes another one, the late rank waits for them to admit it.
    late = take_ticket(store, 2, 1)
    assert restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1) == (1, None)
    assert not store.check([admit_key(late)])
    assert admitted_so_far(store, 1) == 2  # the late ticket is the new group's to admit


def test_the_first_offer_wins_and_any_waiting_rank_completes_it():
    store = dist.HashStore()
    kill_all(store)
    a = take_ticket(store, 0, 1)
    # Slot 0 offers generation 1 (itself alone) and dies before writing anything else.
    store.compare_set(restart_key(1), "", offer(store, 1, ticket_wait_s=0.1).encode())
    mark_dead(store, 0)
    b = take_ticket(store, 1, 1)
    newest, restart = restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1)
    assert newest == 1 and restart is not None and restart.tickets == (Ticket(a, 0, 1),)
    assert store.get(members_key(1)) == b"0" and store.get(admit_key(a)) == b"1"
    assert not store.check([admit_key(b)])
    # Generation 1's only member is dead: slot 1 waits no more, it starts generation 2.
    newest, restart = restart_if_gone(store, newest, SLOTS, ticket_wait_s=0.1)
    assert newest == 2 and restart is not None and restart.members == (1,)
    assert store.get(admit_key(b)) == b"2"


def test_a_generation_a_member_fixed_before_it_died_is_not_fixed_again():
    store = dist.HashStore()
    # Slot 1 survived generation 0's loss, fixed generation 1 alone, then died too.
    store.set(attempt_key(1, 1), "0")
    store.set(members_key(1), "1")
    kill_all(store)
    waiting = take_ticket(store, 1, 1)
    newest, restart = restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1)
    assert newest == 2 and restart is not None and restart.generation == 2
    assert store.get(members_key(1)) == b"1" and store.get(admit_key(waiting)) == b"2"


def test_a_ticket_whose_slot_never_came_is_left_out():
    store = dist.HashStore()
    kill_all(store)
    store.add(JOINS_KEY, 1)  # its process died between taking the number and writing its slot
    waiting = take_ticket(store, 2, 1)
    _, restart = restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.05)
    assert restart is not None and restart.tickets == (Ticket(waiting, 2, 1),) and restart.covered == 2


def test_the_tickets_taken_care_of_are_the_stores_not_the_checkpoints():
    store = dist.HashStore()
    assert admitted_so_far(store, 0) == 0  # a fresh store (a --resume): none, whatever a checkpoint says
    kill_all(store)
    take_ticket(store, 0, 1)
    restart_if_gone(store, 0, SLOTS, ticket_wait_s=0.1)
    grown = take_ticket(store, 1, 1)
    store.set(admit_key(grown), "2")  # the new group's leader took slot 1 back
    take_ticket(store, 2, 1)  # waiting
    assert admitted_so_far(store, 2) == grown == 2


def joiner(store: dist.Store, slot: int, attempt: int) -> LiveGroup:
    return LiveGroup(store, slot, Patience(stale_s=1.0, window_s=2.0, timeout_s=5.0), attempt=attempt,
                     first_members=SLOTS)


@pytest.mark.timeout(30)
def test_a_rank_asking_to_join_a_dead_group_is_admitted_to_the_next_one():
    store = dist.HashStore()
    kill_all(store)
    other = take_ticket(store, 2, 1)
    assert joiner(store, 0, 1).request_join() == (1, (0, 2))
    assert store.get(admit_key(other)) == b"1"


@pytest.mark.timeout(30)
def test_a_rank_coming_back_after_the_run_finished_stops():
    store = dist.HashStore()
    store.set(DONE_KEY, "1")
    kill_all(store)  # every last member went away after the run was done
    assert joiner(store, 1, 1).request_join() is None
    assert not store.check([restart_key(1)]) and not store.check([members_key(1)])
