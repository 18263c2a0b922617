"""The pure rules of an elastic live run (`--world-size MIN:MAX`): the slots of ranks
started by hand, the places up to MAX, who stays when members leave, the minimum, the
line each size change logs and the sizes the summary lists; and the config's refusals of
a bad range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disttrain.config import Config
from disttrain.config.loading import config_from_dict
from disttrain.core.errors import ConfigError
from disttrain.strategies.ddp.live.membership import (
    FREED,
    OPEN,
    Change,
    after_leave,
    arrival_slot,
    below_minimum,
    place_to_take,
    size_change,
    split_batch,
    stepped_in,
    world_sizes,
)


def test_arrivals_take_the_slots_after_the_runs_first_ones_never_reused():
    assert [arrival_slot(2, n) for n in (1, 2, 3)] == [2, 3, 4]
    with pytest.raises(ValueError, match="from 1"):
        arrival_slot(2, 0)


def test_a_rank_keeps_its_own_place_else_takes_a_free_one_else_waits_as_a_spare():
    assert place_to_take(["0", "1", OPEN], 1, spare=True) == 1  # its own (restarted, its place kept)
    assert place_to_take(["0", OPEN, FREED], 3, spare=False) == 1  # an arrival: the first free one
    assert place_to_take(["0", OPEN, FREED], 3, spare=True) == 2  # a spare: a lost member's only
    assert place_to_take(["0", "1", OPEN], 3, spare=True) is None  # room to grow is not a spare's
    assert place_to_take([FREED, "1", "3"], 3, spare=True) == 2  # its own before a freed one
    assert place_to_take(["0", "1", "2"], 3, spare=False) is None  # every place held: it waits


@given(holders=st.lists(st.sampled_from([OPEN, FREED, "0", "1", "2", "3"]), min_size=1, max_size=6),
       slot=st.integers(0, 4), spare=st.booleans())
def test_the_place_taken_is_never_another_ranks_and_a_spare_never_grows_the_run(holders, slot, spare):
    holders = [h for i, h in enumerate(holders) if h in (OPEN, FREED) or h not in holders[:i]]  # one each
    index = place_to_take(holders, slot, spare)
    allowed = {str(slot), FREED} | (set() if spare else {OPEN})
    if index is None:
        assert not allowed & set(holders)
    else:
        assert holders[index] in allowed


def test_the_spares_that_stepped_in_are_the_new_members_marked_as_spares():
    # slot 1 died; spare 2 took its place and joined the survivor 0; slot 4 (an arrival
    # whose launcher took a free place) joined too, not marked
    assert stepped_in((0,), (0, 2, 4), {2}) == (2,)
    assert stepped_in((0, 2), (0, 2), {2}) == ()  # a member already: not again


@given(members=st.sets(st.integers(0, 9), min_size=1, max_size=6), data=st.data())
def test_those_who_stay_are_the_members_but_the_leavers_sorted(members, data):
    leavers = data.draw(st.sets(st.sampled_from(sorted(members))))
    staying = after_leave(tuple(members), leavers)
    assert staying == tuple(sorted(members - leavers))
    assert not set(staying) & leavers


def test_every_member_leaving_leaves_nobody():
    assert after_leave((0, 2), (2, 0)) == ()


def test_a_change_is_a_new_ticket_or_a_leaver():
    assert not Change(3).changes(3)
    assert Change(4).changes(3)
    assert Change(3, (1,)).changes(3)


def test_below_the_minimum_only_when_one_is_set():
    assert below_minimum(1, 2) and not below_minimum(2, 2) and not below_minimum(1, 0)


def test_a_size_change_says_who_came_or_went_and_the_split_of_the_kept_global_batch():
    assert size_change((0, 1), (0, 1, 2), split_batch(32, 3)) == \
        "2 -> 3 ranks (slot 2 joined): the global batch of 32 split 11,11,10"
    assert size_change((0, 1, 2), (0, 2), split_batch(32, 2)) == \
        "3 -> 2 ranks (slot 1 left): the global batch of 32 split 16,16"
    assert size_change((0, 1, 2), (0, 3), (16, 16)) == \
        "3 -> 2 ranks (slot 3 joined, slots 1,2 left): the global batch of 32 split 16,16"


def test_the_sizes_a_run_trained_at_without_repeats():
    recoveries = [{"members": [0, 1, 2]}, {"members": [0, 2]}, {"members": [0, 1]}, {"members": [0]}]
    assert world_sizes(2, recoveries) == [2, 3, 2, 1]
    assert world_sizes(3, []) == [3]


@pytest.mark.parametrize("values, message", [
    ({"ddp": {"max_world_size": 3}}, "ddp.max_world_size: a run that grows and shrinks"),
    ({"ddp": {"recovery": "live", "max_world_size": 1}, "system": {"num_workers": 2}},
     "ddp.max_world_size: 1 is less than system.num_workers (2)"),
    ({"ddp": {"recovery": "live", "join": True}}, "ddp.join: joining a running run needs"),
    ({"ddp": {"recovery": "live", "join": True, "max_world_size": 3}},
     "ddp.join: joining a running run needs"),
])
def test_a_bad_range_is_refused_naming_the_key(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(values)


def test_a_good_range_is_taken():
    config = config_from_dict({"ddp": {"recovery": "live", "max_world_size": 3},
                               "system": {"num_workers": 2}})
    assert isinstance(config, Config) and config.ddp.max_world_size == 3


@pytest.mark.parametrize("values, message", [
    ({"ddp": {"spares": 1}}, "ddp.spares: hot spares step into a live group; they need ddp.recovery: live"),
    ({"ddp": {"recovery": "live", "spares": -1}}, "ddp.spares: -1 must be >= 0"),
    ({"ddp": {"recovery": "live", "spares": 1, "num_nodes": 2, "rdzv_endpoint": "127.0.0.1:29400"},
      "system": {"num_workers": 2}}, "ddp.spares: hot spares of a run of several nodes"),
])
def test_spares_are_refused_where_nothing_would_take_them_in(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(values)


def test_spares_are_taken_by_a_live_run_of_fixed_size_or_a_range():
    assert config_from_dict({"ddp": {"recovery": "live", "spares": 2}}).ddp.spares == 2
    elastic = config_from_dict({"ddp": {"recovery": "live", "spares": 1, "max_world_size": 3},
                                "system": {"num_workers": 2}})
    assert elastic.ddp.spares == 1
    # An arrival shares the run's config: its launcher starts no spares of its own.
    arrival = config_from_dict({"ddp": {"recovery": "live", "spares": 1, "max_world_size": 3, "join": True,
                                        "rdzv_endpoint": "127.0.0.1:29400"}, "system": {"num_workers": 2}})
    assert arrival.ddp.join and arrival.ddp.spares == 1
