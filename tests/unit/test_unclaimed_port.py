"""Rank 0's store port is chosen below the kernel's ephemeral range, where no other socket of
the machine is given it between the agent's choice and rank 0's listen (core.addresses)."""

from __future__ import annotations

import random
import socket

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import api as rendezvous_api

from disttrain.core.addresses import UNCLAIMED_FLOOR, ephemeral_range, unclaimed_port
from disttrain.strategies.ddp.launcher import unclaimed_store_ports

pytestmark = pytest.mark.timeout(30)
RANGE = (32768, 60999)


def test_the_port_lies_below_the_ephemeral_range_and_is_free():
    for seed in range(20):
        port = unclaimed_port(random.Random(seed), ephemeral=RANGE)
        assert UNCLAIMED_FLOOR <= port < RANGE[0]
        with socket.socket() as sock:
            sock.bind(("", port))  # free when returned


def test_a_port_held_by_another_socket_is_passed_over():
    first = random.Random(7).randrange(UNCLAIMED_FLOOR, RANGE[0])
    with socket.socket() as held:
        try:
            held.bind(("", first))
        except OSError:
            pytest.skip(f"port {first} is in use on this machine already")
        held.listen()
        port = unclaimed_port(random.Random(7), ephemeral=RANGE)
    assert port != first and UNCLAIMED_FLOOR <= port < RANGE[0]


def test_without_room_below_the_range_port_zeros_pick_is_taken(tmp_path):
    port = unclaimed_port(random.Random(1), ephemeral=(UNCLAIMED_FLOOR + 10, 60999))
    assert 0 < port <= 65535
    assert ephemeral_range(str(tmp_path / "absent")) is None
    (tmp_path / "range").write_text("32768\t60999\n")
    assert ephemeral_range(str(tmp_path / "range")) == (32768, 60999)


def test_the_agent_gives_rank_0s_store_a_port_below_the_range(monkeypatch):
    monkeypatch.setattr(rendezvous_api, "get_free_port", rendezvous_api.get_free_port)  # restored after
    unclaimed_store_ports()
    info = rendezvous_api.RendezvousStoreInfo.build(0, dist.HashStore(), local_addr="127.0.0.1")
    known = ephemeral_range()
    if known is None:
        pytest.skip("the kernel's ephemeral range cannot be read here (not Linux)")
    assert UNCLAIMED_FLOOR <= info.master_port < known[0]
