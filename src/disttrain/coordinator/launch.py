"""A run's coordinator as its launchers see it, the same for every strategy: where its
registry lives, the process that serves it, and the exits the launcher tells it of.

The parameter-server launcher starts the coordinator under its supervisor (restarted on
its registry when it dies); the DDP launcher starts it beside the ranks. Both describe
it with `coordinator_spec`, keep its registry at `<log_dir>/cluster.db` (emptied at each
launch, `--resume` included; a coordinator restarted within a launch reloads it), and
report the ends of the processes that could not report their own (`ExitReports`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import tenacity

from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.registry import Registry, RegistryError, read_status
from disttrain.core.auth import TOKEN_ENV
from disttrain.core.identity import node_token
from disttrain.core.process_spec import PassedOn, ProcessSpec
from disttrain.core.tls import TlsFiles

logger = logging.getLogger(__name__)

REGISTRY_FILE = "cluster.db"  # in the run's log dir
PATIENCE_S = 120.0  # how long the last exits wait for a coordinator that is being restarted


def run_registry(log_dir: Path) -> Path:
    """The registry of one launch in `log_dir`, which starts with none (its WAL files gone
    too), `--resume` included: the processes an earlier launch registered ended with it. A
    registry kept across launches held them as alive; the new coordinator then declared each
    failed after one heartbeat timeout (a failure and a recovery that never happened, in
    `status` and the summary), and reassigned a worker slow to start. A coordinator
    restarted within a launch reloads the launch's own registry. What happened in an
    earlier launch stays in the coordinator's log, which each launch appends to.

    The generation goes on from the earlier launch's: the shards' checkpoints hold the
    generation each worker registered in, and a shard refuses a registration of an older
    generation than the one it holds for that worker (it reads as a process the run has
    since replaced)."""
    registry = Path(log_dir) / REGISTRY_FILE
    generation = 0
    if registry.exists():
        try:
            generation = read_status(registry, max_events=0).generation
        except RegistryError as e:  # not a registry we can read: the new one starts from 0
            logger.warning("the earlier launch's registry %s cannot be read (%s); generations start "
                           "again from 0", registry, e)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{registry}{suffix}").unlink(missing_ok=True)
    if generation:
        fresh = Registry(registry)
        try:
            fresh.save([], [], generation)
        finally:
            fresh.close()
    return registry


def coordinator_spec(config_path: Path, registry: Path, bind: str, attempt: int,
                     passed: PassedOn) -> ProcessSpec:
    """The `disttrain coordinator` process of a run: its settings from `config_path`,
    listening on `bind` (port 0: a free one, which it reports), its state in `registry`,
    with what its launcher `passed` on. Of the faults, it fires those meant for the
    coordinator (on its `attempt`-th start)."""
    return ProcessSpec("coordinator", config=config_path, bind=bind, registry=registry, faults=passed.faults,
                       attempt=attempt, tls=passed.tls, verbose=passed.verbose)


def token_env(secret: str) -> Callable[[ProcessSpec], dict[str, str]]:
    """The token each child of a launcher gets in its environment (never its command
    line): a worker its own node token (`core.identity`), so it can call only in its own
    name; the coordinator and the shard servers, which check node tokens, the secret."""
    def env(spec: ProcessSpec) -> dict[str, str]:
        if spec.command == "ps-worker" and spec.worker_id:
            return {TOKEN_ENV: node_token(secret, spec.worker_id, "worker")}
        return {TOKEN_ENV: secret}
    return env


class ExitReports:
    """The exits of a run's processes, told to its coordinator at `address`: at once, or,
    while it cannot be reached (it is being restarted), kept for when it is back."""

    def __init__(self, address: str, token: str | None = None, tls: TlsFiles | None = None,
                 timeout_s: float = 5.0):
        self.client = CoordinatorClient(address, timeout_s=timeout_s, token=token, tls=tls)
        self._unreported: list[tuple[str, int, str]] = []

    def report(self, node_id: str, code: int, reason: str) -> None:
        """Tell the coordinator that `node_id` exited with `code` (0: finished) for `reason`."""
        self._unreported.append((node_id, code, reason))
        try:
            self.deliver()
        except CoordinatorError as e:
            logger.info("the coordinator will hear that %s %s once it is back (%s)", node_id, reason, e)

    def deliver(self) -> None:
        """Send what is kept, oldest first. Raises CoordinatorError (what is left stays kept)."""
        while self._unreported:
            self.client.report_exit(*self._unreported[0])
            self._unreported.pop(0)

    def close(self, patience_s: float = PATIENCE_S) -> None:
        """Deliver what is kept, retrying with backoff for up to `patience_s` (the
        coordinator may be restarting), then close."""
        try:
            if self._unreported:
                tenacity.Retrying(retry=tenacity.retry_if_exception_type(CoordinatorError),
                                  wait=tenacity.wait_exponential_jitter(initial=0.1, max=2.0),
                                  stop=tenacity.stop_after_delay(patience_s), reraise=True)(self.deliver)
        except CoordinatorError as e:
            logger.warning("the coordinator's registry misses how %d process(es) ended: %s",
                           len(self._unreported), e)
        finally:
            self.client.close()
