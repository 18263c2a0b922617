"""The places of an elastic live run in its store (a real TCP store on loopback): the host
publishes its range, an arrival whose range differs is refused naming the run's, arrivals
take new slots up to MAX, one past it is refused and gives its place back, and a leave
frees a place for the next arrival."""

from __future__ import annotations

from datetime import timedelta

import pytest

from disttrain.config import Config
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.strategies.ddp.live.group import DONE_KEY
from disttrain.strategies.ddp.live.launcher import (
    PLACES_KEY,
    claim_arrival,
    hosted_store,
    left,
    open_places,
)


def config(minimum: int, maximum: int) -> Config:
    return Config().replace(system={"num_workers": minimum},
                            ddp={"recovery": "live", "max_world_size": maximum, "join": True,
                                 "rdzv_endpoint": "127.0.0.1:1", "timeout_s": 5.0})


@pytest.fixture
def store():
    return hosted_store("127.0.0.1", 0, timedelta(seconds=5))


@pytest.mark.timeout(30)
def test_arrivals_take_new_slots_up_to_the_maximum_and_a_leave_frees_a_place(store):
    open_places(store, config(2, 4), "127.0.0.1:1")
    assert [claim_arrival(store, config(2, 4)) for _ in range(2)] == [2, 3]
    with pytest.raises(DistributedError, match="has its maximum of 4 ranks"):
        claim_arrival(store, config(2, 4))
    assert store.add(PLACES_KEY, 0) == 4  # the refused arrival gave its place back
    left(store, 1)
    assert claim_arrival(store, config(2, 4)) == 4  # a new slot: slots are never reused
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
