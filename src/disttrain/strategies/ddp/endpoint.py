"""Checking a multi-node rendezvous endpoint before torch's agent uses it.

The node whose address the endpoint names hosts the rendezvous store; every other node
connects to it. A host name that does not resolve, or a store that does not answer
within the timeout, would otherwise surface as pages of C++ connection logs; here it
becomes one line. The check retries with backoff until the deadline, because the other
nodes may start before the hosting one.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

from disttrain.core.errors import DistributedError

logger = logging.getLogger(__name__)

FIRST_RETRY_DELAY_S = 0.2
MAX_RETRY_DELAY_S = 2.0


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[IPv6]:PORT`) as (host, port)."""
    return parse_rendezvous_endpoint(endpoint, default_port=-1)


def hosted_here(host: str) -> bool:
    """Whether this machine hosts the store (the same rule torch's c10d backend applies)."""
    return _matches_machine_hostname(host)


def wait_for_endpoint(endpoint: str, timeout_s: float,
                      connect: Callable[[tuple[str, int], float], socket.socket] = socket.create_connection,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once `endpoint` accepts a TCP connection (at once when this node hosts it).

    Raises:
        DistributedError: the host name does not resolve, or nothing answered in `timeout_s`.
    """
    host, port = split_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise DistributedError(f"ddp.rdzv_endpoint: cannot resolve host {host!r} ({e.strerror or e}); "
                               "check the name of the node hosting the rendezvous") from e
    if hosted_here(host):
        return
    deadline = clock() + timeout_s
    delay = FIRST_RETRY_DELAY_S
    while True:
        remaining = deadline - clock()
        try:
            connect((host, port), max(min(remaining, timeout_s), 0.01)).close()
            return
        except OSError as e:
            last_error = e.strerror or ("timed out" if isinstance(e, TimeoutError) else type(e).__name__)
        remaining = deadline - clock()
        if remaining <= 0:
            raise DistributedError(f"ddp.rdzv_endpoint: nothing answered at {endpoint} within "
                                   f"{timeout_s:g}s ({last_error}); check the host and port, and that "
                                   "the node hosting the rendezvous is up")
        logger.debug("rendezvous %s not up yet (%s); retrying", endpoint, last_error)
        # Backoff with jitter, bounded by the deadline: other nodes may start a little later.
        sleep(min(delay * (0.5 + random.random()), remaining))
        delay = min(delay * 2, MAX_RETRY_DELAY_S)
