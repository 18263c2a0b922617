"""The namespace fixture itself: hosts reach each other only on the bridge, and every
namespace is removed afterwards, also when the test body fails, and leftovers of dead
runs are removed before a new network is made."""

from __future__ import annotations

import sys

import pytest
from hosts import namespaces_reason, network  # noqa: F401  (fixtures)
from netns import PREFIX, Network, ip, remove_leftovers, wait_for

LISTEN = """
import socket
with socket.create_server(("{address}", 7000)) as server:  # a fresh namespace: every port is free
    server.settimeout(20)
    print("listening", flush=True)
    connection, _ = server.accept()
    connection.sendall(b"hello from b")
    connection.close()
"""
CONNECT = """
import socket
with socket.create_connection(("{address}", 7000), timeout=10) as connection:
    print(connection.recv(100).decode())
"""


def namespace_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.split()}


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_by_their_addresses_and_are_removed_after_a_failure(network, tmp_path):
    network(["probe"])  # skips where namespaces cannot be made
    made = []
    with pytest.raises(RuntimeError, match="the test failed"), Network(["a", "b"]) as net:
        made = net.namespaces()
        assert set(made) <= namespace_names()
        b = net.hosts["b"]
        listener = b.start([sys.executable, "-c", LISTEN.format(address=b.address)], tmp_path / "b.out")
        wait_for(lambda: "listening" in (tmp_path / "b.out").read_text(), 20, "the listener")
        reply = net.hosts["a"].run(sys.executable, "-c", CONNECT.format(address=b.address))
        assert reply.stdout.strip() == "hello from b"
        assert listener.wait(timeout=20) == 0
        raise RuntimeError("the test failed")
    assert made and not set(made) & namespace_names()


@pytest.mark.timeout(60)
def test_leftovers_of_a_dead_run_are_removed(network):
    network(["probe"])
    dead_pid = 2**22 + 12345  # above the kernel's pid_max: never a live process
    leftover = f"{PREFIX}{dead_pid}x0a"
    ip("netns", "add", leftover)
    assert leftover in remove_leftovers()
    assert leftover not in namespace_names()
