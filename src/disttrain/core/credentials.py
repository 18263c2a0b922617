"""A process's credentials on the run's RPCs: the run's token and its TLS files, which
travel together from the command line to every server it starts and every client it
makes (a server checks callers with them, a client presents them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.core.tls import TlsFiles


@dataclass(frozen=True)
class Credentials:
    """The token and TLS files of one process; both None means open, plain TCP.

    Attributes:
        token: the run's token (`core.auth`): a server refuses calls without it (but health
            checks); a client sends it. None: no token.
        tls: this process's TLS files (`core.tls`): a server listens with TLS (mutual with a
            CA); a client reaches servers with them. None or empty: plain TCP.
    """

    token: str | None = field(default=None, repr=False)  # kept out of reprs, so out of logs
    tls: TlsFiles | None = None
