"""Fixtures of the multi-host tests: a network of namespaces (skipped where it cannot be
made), certificates naming each host's 192.0.2.x address, and reading the event lines a
server prints once it listens."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
from netns import Network, read_event, unavailable_reason
from tls_certs import issue, make_authority

from disttrain.core.processes import PARENT_ENV


@pytest.fixture(scope="session")
def namespaces_reason() -> str | None:
    return unavailable_reason()


@pytest.fixture
def network(namespaces_reason):
    """`network(["a", "b"])` makes hosts a, b at 192.0.2.1, .2; everything is removed at the
    end of the test, whatever its outcome."""
    if namespaces_reason:
        pytest.skip(namespaces_reason)
    made: list[Network] = []

    def make(names: list[str]) -> Network:
        net = Network(names).__enter__()
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()


@pytest.fixture
def host_tls(tmp_path):
    """`host_tls(host)`: the --tls-* flags for a host, its certificate naming its address.
    Every process of these runs holds the run's secret, so each host's certificate is the
    operator's (OU operator): one naming no role would be refused."""
    folder = tmp_path / "pki"
    folder.mkdir()
    authority = make_authority(folder, "run-ca")

    def flags(host) -> list[str]:
        cert, key = issue(authority, folder, host.name, (host.address,), unit="operator")
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(authority.pem_path)]

    return flags


@pytest.fixture
def run_env() -> dict[str, str]:
    """Environment of every process of a run: one token, and this test process as their
    launcher (so servers print the address they bound, and die with the test)."""
    return {"DISTTRAIN_TOKEN": secrets.token_urlsafe(32), PARENT_ENV: str(os.getpid()),
            "OMP_NUM_THREADS": "1"}


def start_coordinator(host, folder: Path, env: dict[str, str]) -> str:
    """Start `disttrain coordinator` on `host` (its registry in `folder`); its address once
    it listens."""
    log = folder / "coordinator.out"
    process = host.start([sys.executable, "-m", "disttrain", "coordinator", "--bind", f"{host.address}:0",
                          "--registry", str(folder / "cluster.db")], log, env)
    return read_event(log, "listening", process)["address"]
