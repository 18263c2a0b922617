"""A forming generation's watch on its members: the launcher's death count against each
member's recorded attempt tells a dead member from the slot's next process, and a watched
wait gives up at the mark (or at its timeout) instead of blocking."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from disttrain.strategies.ddp.live.forming import (
    MemberLost,
    WatchedStore,
    arrive,
    arrived_key,
    attempt_key,
    is_member_lost,
)
from disttrain.strategies.ddp.live.group import LiveGroup, mark_dead
from disttrain.strategies.ddp.live.membership import Patience


def group_of(store: dist.Store, slot: int, attempt: int = 0) -> LiveGroup:
    return LiveGroup(store, slot, Patience(stale_s=1.0, window_s=2.0, timeout_s=5.0), attempt=attempt)


def test_a_member_is_lost_once_its_slot_died_more_often_than_its_attempt():
    store = dist.HashStore()
    mark_dead(store, 2)  # slot 2's first process died before generation 3
    for slot, attempt in ((1, 0), (2, 1)):
        store.set(attempt_key(3, slot), str(attempt))
    group = group_of(store, 0)
    group.generation, group.members = 3, (0, 1, 2)
    group.attempts = {slot: group._attempt_of(3, slot) for slot in group.members}
    assert group.attempts == {0: 0, 1: 0, 2: 1}
    assert group.lost_member() is None  # slot 2 is its second process, alive
    mark_dead(store, 1)
    assert group.lost_member() == "slot 1 died while generation 3 formed"


def test_a_watched_wait_gives_up_at_the_mark_or_at_its_timeout():
    store = dist.HashStore()
    store.set("here", "1")
    lost: list[str] = []
    watched = WatchedStore(store, lambda: lost[0] if lost else None, timeout_s=0.2)
    assert watched.get("here") == b"1"  # a key already set: no wait
    with pytest.raises(RuntimeError, match="Timed out after 0.2s waiting for missing"):
        watched.wait(["missing"])
    lost.append("slot 1 died while generation 4 formed")
    with pytest.raises(MemberLost) as raised:
        watched.wait(["missing"], timedelta(seconds=30))
    assert is_member_lost(raised.value)
    assert is_member_lost(RuntimeError(f"gloo: {lost[0]}"))  # the message survives a rewrap
    assert not is_member_lost(RuntimeError("Connection reset by peer"))


def test_a_watched_wait_lasts_its_own_timeout_whatever_shorter_its_caller_asks():
    # gloo asks its group's timeout, the short connect bound while the group forms.
    now = [0.0]

    def clock() -> float:
        now[0] += 0.5  # each look at the clock: half a second later
        return now[0]

    watched = WatchedStore(dist.HashStore(), lambda: None, timeout_s=3.0, clock=clock)
    with pytest.raises(RuntimeError, match="Timed out after 3s waiting for missing"):
        watched.wait(["missing"], timedelta(seconds=0.5))
    assert now[0] > 3.0  # not given up at the caller's half second
    with pytest.raises(RuntimeError, match="Timed out after 5s"):
        watched.wait(["missing"], timedelta(seconds=5))  # a longer one is kept


def test_members_wait_in_the_store_until_each_has_arrived():
    store = dist.HashStore()
    lost: list[str] = []
    watched = WatchedStore(store, lambda: lost[0] if lost else None, timeout_s=0.2)
    attempts = {0: 0, 1: 2}
    store.set(arrived_key(1, attempts[1]), "1")  # slot 1's third process is there
    arrive(watched, 0, attempts)  # returns: both are
    assert store.check([arrived_key(0, 0)])
    store.delete_key(arrived_key(1, 2))
    store.set(arrived_key(1, 1), "1")  # an earlier process of slot 1 does not count
    with pytest.raises(RuntimeError, match="waiting for arrived/0/0, arrived/1/2"):
        arrive(watched, 0, attempts)
    lost.append("slot 1 died while generation 2 formed")
    with pytest.raises(MemberLost):
        arrive(watched, 0, attempts)
