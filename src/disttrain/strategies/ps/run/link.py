"""A parameter-server process's tie to the run's coordinator, when the run has one:
register (the generation the worker stamps its pushes with), heartbeat with progress,
and follow the membership: on a server, so a synchronous step stops waiting for a worker
the coordinator declared failed, and a barrier for one it reassigned; on a worker, to
stop taking over the blocks of a reassigned worker once it is back."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from disttrain.config.schema import CoordinatorConfig
from disttrain.coordinator.background import HeartbeatSender, MembershipWatcher
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.nodes import REASSIGNED
from disttrain.coordinator.reports import NodeIdentity, NodeReports
from disttrain.core.credentials import Credentials
from disttrain.core.identity import own_token

logger = logging.getLogger(__name__)

# A process the coordinator declared failed exits with this code; its supervisor restarts it.
EXIT_DECLARED_FAILED = 75


@dataclass
class Link:
    client: CoordinatorClient
    generation: int
    heartbeats: HeartbeatSender
    watcher: MembershipWatcher | None = None
    run_finished: bool = False  # every shard was done when this process joined

    def leave(self) -> None:
        """Send a last heartbeat and the latest metrics (best effort), so the coordinator
        holds where this process ended, and tell it this process finished (at once: the
        silence of a process on its way out is not taken for a failure), then close."""
        self.heartbeats.last_beat()
        try:
            self.client.report_exit(self.heartbeats.node_id, 0, "finished")
        except CoordinatorError as e:
            logger.warning("could not tell the coordinator this process finished: %s", e)
        self.close()

    def close(self) -> None:
        self.heartbeats.stop()
        if self.watcher is not None:
            self.watcher.stop()
        self.client.close()


def _declared_failed(node_id: str) -> Callable[[], None]:
    def exit_now() -> None:
        logger.error("the coordinator declared %s failed (it missed its heartbeats); exiting so it "
                     "is restarted, and no gradient of it is applied any more", node_id)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_DECLARED_FAILED)

    return exit_now


def join(settings: CoordinatorConfig, node: NodeIdentity, reports: NodeReports,
         on_membership: Callable[[int, dict[str, int], dict[str, int]], None] | None = None,
         credentials: Credentials | None = None) -> Link | None:
    """Register with the coordinator at `settings.address` and start heartbeats; None when
    the run has no coordinator.

    Args:
        node: this process's id, role, rank and the address it serves on.
        reports: this process's progress (and a worker's balance state), read at every
            heartbeat, and a worker's latest training metrics, read after every heartbeat
            and reported when new.
        on_membership: called with (generation, live worker ids -> the generation each
            joined in, reassigned worker ids -> their rank) at every change of membership.
        credentials: the run's token and the TLS files to reach it with (None or empty:
            plain TCP). A node token is sent as it is; given the run's secret (a shard
            holds it to check the workers' tokens), the process calls in its own name, with
            the node token of the node in its role made from it.
    Raises:
        CoordinatorError: the coordinator refused (another live process holds `node_id`).
    """
    if not settings.address:
        return None
    token, tls = (None, None) if credentials is None else (credentials.token, credentials.tls)
    client = CoordinatorClient(settings.address, tls=tls,
                               token=own_token(token, node.node_id, node.role) if token else None)
    reply = client.register(node.node_id, node.role, rank=node.rank, address=node.address)
    logger.info("joined the run's coordinator at %s as %s (generation %d, %d restart(s) before)",
                settings.address, node.node_id, reply.generation, reply.restarts)
    heartbeats = HeartbeatSender(client, node, settings.heartbeat_interval, reports,
                                 _declared_failed(node.node_id), generation=reply.generation)
    heartbeats.start()
    watcher = None
    if on_membership is not None:
        def changed(membership) -> None:
            live = {m.node_id: m.joined_generation for m in membership.members
                    if m.role == "worker" and m.state == "alive"}
            away = {m.node_id: m.rank for m in membership.members
                    if m.role == "worker" and m.state == REASSIGNED}
            on_membership(membership.generation, live, away)

        watcher = MembershipWatcher(client, changed)
        watcher.start()
    return Link(client, reply.generation, heartbeats, watcher, run_finished=reply.run_finished)
