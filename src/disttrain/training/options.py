"""How to run, beside what to train: the options every strategy takes with the config.

Importable without torch: the command line parses into it before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.core.credentials import Credentials
from disttrain.core.faults import Fault
from disttrain.core.tls import TlsFiles


@dataclass(frozen=True)
class RunOptions:
    """How to run, beside what to train (the config).

    Args:
        resume: continue from the newest checkpoint instead of refusing a folder holding one.
        faults: faults to inject, for tests and drills.
        verbose: debug logging in every process of the run.
        attempt: how often this process was restarted before (faults fire on attempt 0
            unless they name another).
        token: the run's shared token (`core.auth`): servers refuse calls without it,
            clients send it; None: servers run open. Kept out of reprs, so out of logs.
        tls: the process's TLS files (`core.tls`), its identity both as a server and as a
            client; empty: plain TCP.
    """

    resume: bool = False
    faults: tuple[Fault, ...] = ()
    verbose: bool = False
    attempt: int = 0
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles = TlsFiles()

    @property
    def credentials(self) -> Credentials:
        """The token and TLS files, as servers and clients take them."""
        return Credentials(self.token, self.tls)
