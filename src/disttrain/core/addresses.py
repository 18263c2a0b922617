"""Network addresses as users type them (`HOST:PORT`, `[IPv6]:PORT`, and lists of them),
and whether a peer is on this host."""

from __future__ import annotations

import ipaddress
import random
import socket

from disttrain.core.errors import ConfigError


def split_host_port(text: str) -> tuple[str, int]:
    """Split "host:port" (port 0-65535; 0 means any free port when binding).

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = text.strip().rpartition(":")
    # "[::]:50051" keeps its brackets: gRPC binds and dials IPv6 hosts written that way.
    if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} must look like HOST:PORT (port 0-65535), e.g. 127.0.0.1:50051")
    return host, int(port)


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """`split_host_port` for user input: a bad address is a ConfigError naming `what`."""
    try:
        return split_host_port(text)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from e


def parse_address_list(text: str, what: str) -> list[str]:
    """Split "h:p,h:p" into its addresses, in order, each checked.

    Raises:
        ConfigError: the list is empty, or an entry is not HOST:PORT.
    """
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    if not addresses:
        raise ConfigError(f"{what}: give HOST:PORT[,HOST:PORT...]")
    for address in addresses:
        parse_address(address, what)
    return addresses


def peer_is_local(peer: str) -> bool:
    """Whether a gRPC peer ("ipv4:10.0.0.2:5123", "ipv6:[::1]:5123", "unix:/path") is on
    this host: a loopback or Unix-socket peer, or an address of one of this host's (this
    network namespace's) interfaces, which a socket can bind to and a remote one cannot."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = rest.rpartition(":")[0].strip("[]")
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return True
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:  # EADDRNOTAVAIL: no interface here holds it
            return False
    return True


# Ports below the kernel's ephemeral range that `unclaimed_port` draws from (their floor).
UNCLAIMED_FLOOR = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The ports the kernel hands out for port 0 and outgoing connections, or None where
    the range cannot be read (not Linux)."""
    try:
        with open(path) as file:
            low, high = (int(part) for part in file.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def unclaimed_port(rng: random.Random | None = None, attempts: int = 64,
                   ephemeral: tuple[int, int] | None = None) -> int:
    """A free port for a server another process will open later, below the ephemeral range.

    A port found by binding port 0 and closing the socket is free for a moment only: it is
    drawn from the ephemeral range, from which the kernel also gives every other process's
    port 0 and outgoing connections, and on a busy machine one of them can take it before
    the server listens (torch's `get_free_port`, which its elastic agent uses for rank 0's
    store: rank 0 then failed with EADDRINUSE seconds later, in the suite under load). The
    kernel hands a port below that range to nobody: only a process binding that very number
    can take it. Where the range is unknown, or leaves no room below it, this falls back to
    port 0's pick.
    """
    rng = rng or random.Random()
    known = ephemeral if ephemeral is not None else ephemeral_range()
    if known is not None and known[0] - UNCLAIMED_FLOOR >= 1024:
        for _ in range(attempts):
            port = rng.randrange(UNCLAIMED_FLOOR, known[0])
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _bindable(port: int) -> bool:
    """Whether nothing on this host holds `port` (TCP, every IPv4 address)."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
