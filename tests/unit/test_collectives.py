"""The rule that picks DDP's collective for payloads that cannot be summed (the hook's
`ddp_collective: auto` and `advise` share it): the fewest bytes a rank receives, ties to
the one of fewer phases, two-phase only for int8; its byte counts against those the
two-phase benchmark measured on a real gloo group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disttrain.compression import collectives

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "two_phase_allreduce.json"


@given(n=st.integers(1, 4096), payload=st.floats(0, 1e9), dense=st.floats(0, 1e9), two_phase=st.booleans())
def test_the_choice_receives_the_fewest_bytes_of_those_allowed(n, payload, dense, two_phase):
    chosen = collectives.cheapest(n, payload, dense, two_phase)
    allowed = collectives.COLLECTIVES if two_phase else (collectives.GATHER, collectives.DENSE)
    assert chosen in allowed
    assert collectives.received_bytes(chosen, n, payload, dense) == min(
        collectives.received_bytes(c, n, payload, dense) for c in allowed)


def test_ties_go_to_fewer_phases_and_two_ranks_gather():
    assert collectives.cheapest(1, 10, 40, True) == collectives.GATHER  # nothing to receive
    assert collectives.cheapest(2, 10, 40, True) == collectives.GATHER  # (n - 1) P == 2 (n - 1) / n P
    assert collectives.cheapest(3, 10, 40, True) == collectives.TWO_PHASE
    # top-k at 1% with 8-byte entries: a payload of G / 50 gathers up to 100 ranks
    assert collectives.cheapest(100, 1, 50, False) == collectives.GATHER
    assert collectives.cheapest(101, 1, 50, False) == collectives.DENSE


def test_two_phase_bytes_stay_flat_as_ranks_are_added():
    sizes = [collectives.received_bytes(collectives.TWO_PHASE, n, 1.0, 4.0) for n in (2, 8, 1024)]
    assert sizes[0] == 1.0 and max(sizes) < 2.0


def test_an_unknown_collective_or_no_rank_is_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        collectives.received_bytes("ring", 4, 1, 4)
    with pytest.raises(ValueError, match="at least one rank"):
        collectives.received_bytes(collectives.GATHER, 0, 1, 4)


def test_the_counts_are_those_the_benchmark_measured_on_the_wire():
    results = json.loads(RESULTS.read_text())["ranks"]
    for n, row in results.items():
        parameters = row["two_phase"]["parameters"]
        for collective in (collectives.GATHER, collectives.TWO_PHASE):
            assert row[collective]["bytes_measured"]
            predicted = collectives.received_bytes(collective, int(n), parameters, 4 * parameters)
            # int8 payloads: a byte per parameter, and a scale per tensor or chunk
            measured = row[collective]["received_bytes_per_rank"]
            assert predicted == pytest.approx(measured, rel=0.01), (n, collective)
