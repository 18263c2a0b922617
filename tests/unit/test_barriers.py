"""Named barriers of the parameter server: complete once every rank arrived, kept for a
restarted worker; a barrier of a step is given up, for everyone, rather than waited for
when a rank is behind, re-registers or leaves."""

from __future__ import annotations

import pytest

from disttrain.strategies.ps.server.barriers import (
    MAX_KEPT,
    PENDING_PER_WORKER,
    BarrierMismatch,
    Barriers,
    TooManyBarriers,
)
from disttrain.strategies.ps.server.decisions import PushRefused


def test_a_barrier_completes_once_every_rank_arrived_and_keeps_its_answer():
    barriers = Barriers(2)
    barriers.arrive("start", 1, [2.0])
    assert barriers.result("start") is None
    barriers.arrive("start", 0, [1.0])
    assert barriers.result("start") == [[1.0], [2.0]]
    barriers.arrive("start", 1, [9.0])  # a restarted worker gets the same answer
    assert barriers.result("start") == [[1.0], [2.0]]
    with pytest.raises(BarrierMismatch) as refused:
        barriers.arrive("other", 0, [1.0]) or barriers.arrive("other", 1, [1.0, 2.0])
    assert isinstance(refused.value, PushRefused)  # refused as a bad push is: nothing changes


def test_a_check_is_given_up_at_once_when_a_rank_is_behind():
    barriers = Barriers(2)
    barriers.arrive("speeds@16", 0, [100.0], step=16, last_steps={0: 16, 1: 16})
    assert barriers.result("speeds@16") is None  # in step: worth the wait of a few milliseconds
    barriers.arrive("speeds@16", 1, [50.0], step=16, last_steps={0: 16, 1: 16})
    assert barriers.result("speeds@16") == [[100.0], [50.0]]
    barriers.arrive("speeds@24", 0, [100.0], step=24, last_steps={0: 24, 1: 20})
    assert barriers.result("speeds@24") == []  # rank 1 is redoing steps: it needs rank 0's
    barriers.arrive("speeds@24", 1, [50.0], step=24, last_steps={0: 24, 1: 24})
    assert barriers.result("speeds@24") == []  # the late rank gets the same answer


def test_a_re_registration_or_a_departure_gives_up_the_pending_checks_only():
    barriers = Barriers(2)
    barriers.arrive("speeds@8", 0, [1.0], step=8, last_steps={0: 8, 1: 8})
    barriers.arrive("epoch0:trained", 0, [])
    assert barriers.give_up_pending() and not barriers.give_up_pending()
    assert barriers.result("speeds@8") == [] and barriers.result("epoch0:trained") is None
    state = barriers.state_dict()
    restored = Barriers(2)
    restored.load_state_dict(state)
    assert restored.result("speeds@8") == []  # a restarted shard answers it the same


def test_the_oldest_checks_make_room_before_the_barriers_a_restarted_worker_meets_again():
    barriers = Barriers(1)
    barriers.arrive("speeds", 0, [1.0])
    barriers.arrive("epoch0:trained", 0, [])
    for step in range(1, MAX_KEPT + 10):
        barriers.arrive(f"speeds@{step}", 0, [1.0], step=step, last_steps={0: step})
    assert barriers.result("speeds") == [[1.0]] and barriers.result("epoch0:trained") == [[]]
    assert barriers.result("speeds@1") is None and barriers.result(f"speeds@{MAX_KEPT + 9}") == [[1.0]]


def test_a_worker_waits_at_only_its_share_of_pending_barriers_and_the_others_keep_theirs():
    barriers = Barriers(3)
    for i in range(PENDING_PER_WORKER):  # rank 2 makes up names nobody else will come to
        barriers.arrive(f"made-up{i}", 2, [1.0], now=0.0)
    with pytest.raises(TooManyBarriers, match="rank 2 already waits at 4 pending barriers"):
        barriers.arrive("one more", 2, [1.0], now=1.0)
    assert "one more" not in barriers.pending
    barriers.arrive("made-up0", 2, [5.0], now=1.0)  # its own, again: renewed, not refused
    barriers.arrive("epoch0:trained", 0, [1.0], now=1.0)  # the others are served beside it
    barriers.arrive("epoch0:trained", 1, [1.0], now=1.0)
    assert barriers.result("epoch0:trained") is None and barriers.waiting(0, 1.0) == ["epoch0:trained"]
    with pytest.raises(TooManyBarriers):  # its own share is full, for any name
        barriers.arrive("epoch0:trained", 2, [1.0], now=2.0)
    for now in (60.0, 120.0):  # the others wait on (renewed); its made-up ones lapse
        barriers.arrive("epoch0:trained", 0, [1.0], now=now)
        barriers.arrive("epoch0:trained", 1, [1.0], now=now)
    barriers.arrive("epoch0:trained", 2, [1.0], now=120.0)
    assert barriers.result("epoch0:trained") == [[1.0]] * 3 and barriers.pending == []


def test_a_barrier_nobody_waits_at_expires_and_a_waited_one_never_does():
    barriers = Barriers(2, expiry_s=90.0)
    barriers.arrive("made-up", 1, [1.0], now=0.0)  # left behind: its worker stopped waiting
    barriers.arrive("epoch0:trained", 0, [1.0], now=0.0)
    for now in range(30, 600, 30):  # rank 0 waits (its long-poll renews it), rank 1 is slow
        barriers.arrive("epoch0:trained", 0, [1.0], now=float(now))
    assert barriers.pending == ["epoch0:trained"] and barriers.num_expired == 1
    barriers.arrive("epoch0:trained", 1, [2.0], now=600.0)
    assert barriers.result("epoch0:trained") == [[1.0], [2.0]]
    assert barriers.result("made-up") is None  # forgotten, not answered: arriving again starts it anew


def test_a_lapsed_arrival_frees_its_share_but_still_counts_for_its_barrier():
    barriers = Barriers(3, expiry_s=90.0)
    for i in range(PENDING_PER_WORKER):
        barriers.arrive(f"b{i}", 0, [float(i)], now=0.0)
    barriers.arrive("b0", 1, [9.0], now=50.0)  # rank 1 waits at b0: rank 0's arrival stays there
    barriers.arrive("b4", 0, [4.0], now=100.0)  # rank 0 died waiting; back, its share is free again
    assert barriers.pending == ["b0", "b4"]  # b1..b3: nobody waits, expired
    barriers.arrive("b0", 2, [8.0], now=120.0)  # rank 0's lapsed arrival completes it
    assert barriers.result("b0") == [[0.0], [9.0], [8.0]]
