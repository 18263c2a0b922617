"""The coordinator of a DDP run, seen from the launcher: start one beside the ranks, and
tell it how the ranks ended.

A single-node run starts `disttrain coordinator` as a child process (bound to a free
port on 127.0.0.1, its registry at `<log_dir>/cluster.db`) unless `coordinator.address`
names a running one. Each launch starts a fresh registry (`--resume` too: the ranks of an
earlier launch ended with it). The ranks find the coordinator through
`coordinator.address` in the config they read, register and heartbeat (`heartbeats`),
and report their own end. The launcher reports the ends the ranks could not (a rank
killed in the last attempt, the ranks the agent stopped, a stopped launcher), then
stops the coordinator; `disttrain status --registry <log_dir>/cluster.db` shows the run
afterwards. The coordinator refuses calls without the run's token (the user's, else a
random one per launch), which it and the ranks get through their environment.

A multi-node run shares one coordinator (`--coordinator HOST:PORT`); without one its
ranks run unwatched, since a coordinator per node would only see part of the run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from disttrain.config import Config
from disttrain.coordinator.launch import ExitReports, coordinator_spec, run_registry
from disttrain.core.auth import TOKEN_ENV, new_token
from disttrain.core.faults import Fault
from disttrain.core.process_spec import PassedOn
from disttrain.core.processes import Cluster
from disttrain.core.tls import TlsFiles
from disttrain.strategies.ddp.heartbeats import node_id

logger = logging.getLogger(__name__)

BIND = "127.0.0.1:0"
CALL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RunCoordinator:
    """The coordinator the ranks of this launch report to.

    Args:
        config: the run's config with `coordinator.address` set ("" when the run has none).
        local_ranks: the global ranks this launcher runs, when it knows them (one node).
        registry: the registry of the coordinator this launcher started, else None.
        token: the token every call to the coordinator carries (None: it runs open).
        tls: the TLS files the coordinator serves and is reached with (empty: plain TCP).
    """

    config: Config
    local_ranks: tuple[int, ...]
    registry: Path | None = None
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles = TlsFiles()

    @property
    def address(self) -> str:
        return self.config.coordinator.address

    def finished(self) -> None:
        """Every local rank ended well (a rank that reported itself already is left as is)."""
        self.report({rank: (0, "finished") for rank in self.local_ranks})

    def stopped(self, reason: str, exits: Mapping[int, tuple[int, str]] | None = None) -> None:
        """The ranks ended badly: `exits` holds the (exit code, reason) of those whose end is
        known (global rank -> ...); the other local ranks were stopped for `reason`."""
        known = dict(exits or {})
        self.report({**{rank: (1, reason) for rank in self.local_ranks if rank not in known}, **known})

    def report(self, exits: Mapping[int, tuple[int, str]]) -> None:
        """Tell the coordinator each rank's (exit code, reason); best effort, one try each."""
        if not self.address or not exits:
            return
        reports = ExitReports(self.address, self.token, self.tls, timeout_s=CALL_TIMEOUT_S)
        for rank, (code, reason) in sorted(exits.items()):
            reports.report(node_id(rank), code, reason)
        reports.close(patience_s=0.0)


@contextmanager
def run_coordinator(config: Config, config_path: Path, token: str | None = None,
                    tls: TlsFiles | None = None, faults: tuple[Fault, ...] = ()) -> Iterator[RunCoordinator]:
    """Have a coordinator for the run while the block runs; yields where the ranks find it.

    Starts one as a child process for a single-node run without `coordinator.address`
    (stopped when the block ends), reading its settings from `config_path`; it requires
    `token`, or a fresh random one when None (the yielded `token`), serves with `tls` when
    it is enabled, and fires those of `faults` meant for the coordinator.

    Raises:
        DistributedError: the coordinator did not start (its log is named).
    """
    tls = tls or TlsFiles()
    world_size, num_nodes = config.system.num_workers, config.ddp.num_nodes
    local_ranks = tuple(range(world_size)) if num_nodes == 1 else ()
    if config.coordinator.address:
        yield RunCoordinator(config, local_ranks, token=token, tls=tls)
        return
    if num_nodes > 1:
        logger.info("no coordinator watches this multi-node run; start `disttrain coordinator` on one "
                    "machine and pass --coordinator HOST:PORT to every node to see it in `disttrain status`")
        yield RunCoordinator(config, local_ranks, token=token, tls=tls)
        return
    token = token or new_token()
    log_dir = Path(config.system.log_dir)
    registry = run_registry(log_dir)
    with Cluster(log_dir, env={TOKEN_ENV: token}) as cluster:
        cluster.spawn("coordinator", coordinator_spec(config_path, registry, BIND, 0, PassedOn(faults, tls)))
        address = cluster.wait_listening("coordinator")
        logger.info("coordinator listening on %s (registry %s)", address, registry)
        coordinator = RunCoordinator(config.replace(coordinator={"address": address}), local_ranks, registry,
                                     token, tls)
        yield coordinator
