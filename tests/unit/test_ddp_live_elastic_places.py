"""The places of a live run in its store (a real TCP store on loopback): the host
publishes its range, an arrival whose range differs is refused naming the run's, arrivals
take new slots up to MAX, one past it is refused when the run has no spares and waits as
a spare when it has, a leave frees a place for the next arrival, and a spare waiting for a
place steps in once one is freed (marked in the store for the leader), leaves on SIGTERM,
or stops when the run ends."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from disttrain.config import Config
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.strategies.ddp.live.group import DONE_KEY
from disttrain.strategies.ddp.live.launcher import hosted_store
from disttrain.strategies.ddp.live.membership import FREED, OPEN
from disttrain.strategies.ddp.live.places import (
    claim_arrival,
    free_places,
    holders,
    left,
    num_places,
    open_places,
    spare_key,
    spare_slots,
    take_place,
    wait_for_place,
)


def config(minimum: int, maximum: int, spares: int = 0) -> Config:
    return Config().replace(system={"num_workers": minimum},
                            ddp={"recovery": "live", "max_world_size": maximum, "join": True,
                                 "rdzv_endpoint": "127.0.0.1:1", "timeout_s": 5.0, "spares": spares})


def run_config(num_workers: int, spares: int) -> Config:
    """A run of fixed size with spares (its own launcher's config)."""
    return Config().replace(system={"num_workers": num_workers}, ddp={"recovery": "live", "spares": spares})


@pytest.fixture
def store():
    return hosted_store("127.0.0.1", 0, timedelta(seconds=5))


@pytest.mark.timeout(30)
def test_arrivals_take_new_slots_up_to_the_maximum_and_a_leave_frees_a_place(store):
    open_places(store, config(2, 4), "127.0.0.1:1")
    assert [claim_arrival(store, config(2, 4)) for _ in range(2)] == [2, 3]
    with pytest.raises(DistributedError, match="has its maximum of 4 ranks .* and no spares"):
        claim_arrival(store, config(2, 4))
    assert holders(store) == ["0", "1", "2", "3"]  # the refused arrival took nothing
    left(store, 1)
    assert holders(store) == ["0", FREED, "2", "3"]
    assert claim_arrival(store, config(2, 4)) == 4  # a new slot: slots are never reused
    assert holders(store) == ["0", "4", "2", "3"]  # in the freed place
    assert store.add("deaths/1", 0) == 1  # a leaver is marked as gone, for a group forming with it


@pytest.mark.timeout(30)
def test_an_arrival_with_another_range_is_refused_naming_the_runs(store):
    open_places(store, config(2, 3), "127.0.0.1:1")
    with pytest.raises(ConfigError, match="started with --world-size 2:3; pass --world-size 2:3"):
        claim_arrival(store, config(2, 4))


@pytest.mark.timeout(30)
def test_no_arrival_into_a_run_that_ended(store):
    open_places(store, config(2, 3), "127.0.0.1:1")
    store.set(DONE_KEY, "1")
    with pytest.raises(DistributedError, match="has ended"):
        claim_arrival(store, config(2, 3))


def test_a_run_counts_places_when_elastic_or_with_spares():
    assert num_places(config(2, 4)) == 4
    assert num_places(run_config(2, 1)) == 2  # its size, which the spares wait to fill
    assert num_places(run_config(2, 0)) == 0  # fixed size, no spares: a restart takes its slot back


@pytest.mark.timeout(30)
def test_spares_take_slots_past_the_first_ones_and_hold_no_place(store):
    open_places(store, run_config(2, 2), "127.0.0.1:1")
    assert spare_slots(store, run_config(2, 2)) == [2, 3]
    assert holders(store) == ["0", "1"]
    assert [take_place(store, slot) for slot in (0, 2)] == ["held", "full"]


@pytest.mark.timeout(30)
def test_an_arrival_at_the_maximum_of_a_run_with_spares_waits_as_one(store):
    open_places(store, config(2, 3, spares=1), "127.0.0.1:1")
    spare, = spare_slots(store, config(2, 3, spares=1))
    assert claim_arrival(store, config(2, 3)) == 3  # the free third place
    assert claim_arrival(store, config(2, 3)) == 4  # no place: not refused, it will wait
    assert holders(store) == ["0", "1", "3"] and spare == 2


@pytest.mark.timeout(30)
def test_a_spare_of_an_elastic_run_does_not_grow_it_but_takes_a_lost_members_place(store):
    open_places(store, config(2, 3, spares=1), "127.0.0.1:1")
    spare, = spare_slots(store, config(2, 3, spares=1))
    assert take_place(store, spare) == "full"  # the open third place is room to grow, for arrivals
    assert holders(store) == ["0", "1", OPEN]
    left(store, 0)  # a member leaves: its place is the spare's to take
    assert take_place(store, spare) == "taken" and holders(store) == [str(spare), "1", OPEN]


@pytest.mark.timeout(30)
def test_a_waiting_spare_steps_in_once_a_lost_members_place_is_freed(store):
    open_places(store, run_config(2, 1), "127.0.0.1:1")
    spare, = spare_slots(store, run_config(2, 1))
    waiting = threading.Event()
    result: list[bool] = []

    def wait() -> None:
        result.append(wait_for_place(store, spare, 0, lambda: (waiting.set(), False)[1]))

    thread = threading.Thread(target=wait)
    thread.start()
    assert waiting.wait(10)  # it looked, found every place held, and waits
    assert not result and not store.check([spare_key(spare, 0)])
    free_places(store, 1)  # slot 1 died (the launcher frees its place in a run with spares)
    thread.join(10)
    assert result == [True] and holders(store) == ["0", str(spare)]
    assert store.check([spare_key(spare, 0)])  # the leader names it a spare that stepped in
    # The lost slot's process started again finds no place: it would wait as a spare now.
    assert take_place(store, 1) == "full"


@pytest.mark.timeout(30)
def test_a_rank_that_holds_its_place_is_no_spare(store):
    open_places(store, run_config(2, 1), "127.0.0.1:1")
    assert wait_for_place(store, 1, 1, lambda: False)  # slot 1 restarted, its place kept
    assert not store.check([spare_key(1, 1)])


@pytest.mark.timeout(30)
def test_a_waiting_spare_stops_when_the_run_ends_or_on_sigterm(store):
    open_places(store, run_config(1, 1), "127.0.0.1:1")
    assert wait_for_place(store, 1, 0, lambda: True) is False  # SIGTERM while waiting
    store.set(DONE_KEY, "1")
    assert wait_for_place(store, 1, 0, lambda: False) is False  # the run ended
    assert holders(store) == ["0"]
