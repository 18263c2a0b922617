"""The `ps` strategy: a whole parameter-server run on this machine, supervised.

Starts a coordinator (unless `coordinator.address` names a running one), then
`ps.num_servers` shard servers on free ports (each reports the port it bound), then
`system.num_workers` workers pointed at them; shows one progress display for the
cluster; streams every process's output to `<log_dir>/<name>.log`. Every process
registers with the coordinator and heartbeats. A process that fails (exits with an
error, or stops heartbeating) is restarted where it was, up to
`coordinator.max_restarts` times, while the others train on; a coordinator that dies is
restarted on its registry (`<log_dir>/cluster.db`). Worker 0 writes
`parameter_server_final.pt` and `summary.json` (strategy ps-sync, ps-ssp or ps-async)
when every worker is done; the launcher adds each failure and its recovery. Every
server refuses calls without the run's token (the user's, else a random one per run),
which the children get through their environment; with TLS files, every process gets
the same `--tls-*` flags and serves and connects with TLS.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import tenacity

from disttrain.config import Config
from disttrain.coordinator.client import CoordinatorClient, CoordinatorError
from disttrain.coordinator.supervisor import Managed, Supervisor
from disttrain.core import checkpoint as ckpt
from disttrain.core.auth import TOKEN_ENV, new_token
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.core.faults import format_fault
from disttrain.core.processes import Cluster, Event, raise_on_sigterm
from disttrain.metrics.summary import SUMMARY_FILE, RunSummary
from disttrain.strategies.ps.run.progress import ClusterWatch
from disttrain.strategies.ps.run.recovery import recovery_summary
from disttrain.training.models import init_model
from disttrain.training.options import RunOptions

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 60.0
REGISTRY_FILE = "cluster.db"


def run_cluster(config: Config, options: RunOptions) -> RunSummary:
    """Run the coordinator, servers and workers as child processes until the run ends.

    Raises:
        ConfigError: bad input found before any process starts (an unknown model,
            checkpoints of an earlier run in the folder without `--resume`).
        DistributedError: a process failed more often than `coordinator.max_restarts`
            (its name, exit code and log are named), or did not start.
    """
    started = time.perf_counter()
    preflight(config, options)
    log_dir = Path(config.system.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / SUMMARY_FILE).unlink(missing_ok=True)
    registry = log_dir / REGISTRY_FILE
    if not options.resume:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{registry}{suffix}").unlink(missing_ok=True)
    raise_on_sigterm()
    # One token per run unless the user gave one; children get it through their
    # environment (a command line is readable by every user), restarted ones too.
    options = replace(options, token=options.token or new_token())
    with Cluster(log_dir, env={TOKEN_ENV: options.token}) as cluster:
        run = ClusterRun(cluster, config, options, log_dir / "config.yaml")
        run.start(registry)
        run.supervise()
    try:
        summary = RunSummary.read(log_dir / SUMMARY_FILE)
    except (OSError, ValueError) as e:
        raise DistributedError(f"worker 0 did not write the run summary in {log_dir}: {e}") from e
    summary.total_time_s = time.perf_counter() - started  # the whole command, start-up included
    summary.extra.update(recovery_summary(run.supervisor.failures, registry))
    summary.write(log_dir)
    return summary


def check_supported(config: Config) -> None:
    """Raises ConfigError for settings the parameter server does not offer."""
    if config.compression.enabled and config.compression.type == "powersgd":
        raise ConfigError("compression.type: powersgd compresses DDP's all-reduce and is not "
                          "offered on the parameter server; use quantization, topk, fp16 or bf16")


def preflight(config: Config, options: RunOptions) -> None:
    """What can be checked before starting processes.

    Raises:
        ConfigError: see `run_cluster`.
    """
    check_supported(config)
    init_model(config.training)  # an unknown model or data set fails here, once
    folder = Path(config.system.checkpoint_dir)
    for name in [f"server{s}" for s in range(config.ps.num_servers)] + \
            [f"worker{r}" for r in range(config.system.num_workers)]:
        ckpt.prepare_checkpoint_dir(folder / name, resume=options.resume)


class ParameterServer:
    name = "ps"

    def run(self, config: Config, options: RunOptions) -> RunSummary:
        return run_cluster(config, options)


STRATEGY = ParameterServer()


def start_servers(cluster: Cluster, args: list[str], bind_host: str, num_servers: int) -> list[str]:
    """Start `num_servers` shard servers on free ports, unsupervised (for runs whose workers
    are started by hand); their addresses in shard order. Raises DistributedError when one
    exits or does not report its address in time."""
    for shard in range(num_servers):
        cluster.spawn(f"server{shard}", ["ps-server", *args, "--bind", f"{bind_host}:0",
                                         "--shard", f"{shard}/{num_servers}"])
    addresses: dict[int, str] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(addresses) < num_servers:
        event = cluster.next_event(max(0.0, deadline - time.monotonic()))
        if event is None or event.kind == "exit":
            raise DistributedError(f"servers did not start within {STARTUP_TIMEOUT_S:.0f}s; see "
                                   f"{cluster.log_dir}/server*.log")
        if event.kind == "listening":
            addresses[int(event.fields["shard"])] = str(event.fields["address"])
    return [addresses[s] for s in range(num_servers)]


@dataclass
class ClusterRun:
    """The processes of one run and the supervisor that keeps them going."""

    cluster: Cluster
    config: Config
    options: RunOptions
    config_path: Path

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.cluster, self.config.coordinator.max_restarts, self._report_exit)
        self.coordinator: CoordinatorClient | None = None
        self._binds: dict[str, list[str]] = {}  # server -> [the address it binds]
        self._listening: dict[str, str] = {}
        self._early: list[Event] = []  # events that came while waiting for addresses
        self._unreported: list[tuple[str, int, str]] = []  # exits the coordinator has not heard of

    def _common(self, attempt: int) -> list[str]:
        """Arguments of every server and worker start (attempt > 0: a restart, resuming)."""
        faults = [f"--inject={format_fault(fault)}" for fault in self.options.faults]
        resume = ["--resume"] if attempt > 0 or self.options.resume else []
        return ["--config", str(self.config_path), *(["-v"] if self.options.verbose else []), *faults,
                *resume, "--attempt", str(attempt), *self.options.tls.args()]

    def start(self, registry: Path) -> None:
        """Start the coordinator (unless one runs already), the servers, then the workers."""
        config = self.config
        config.save(self.config_path)
        address = config.coordinator.address or self._start_coordinator(registry)
        self.config = config.replace(coordinator={"address": address})
        self.config.save(self.config_path)  # every process finds the coordinator here
        self.coordinator = CoordinatorClient(address, token=self.options.token, tls=self.options.tls)
        servers = [self._start_server(shard) for shard in range(config.ps.num_servers)]
        addresses = [self._wait_listening(name) for name in servers]
        logger.info("servers listening on %s", ", ".join(addresses))
        for rank in range(config.system.num_workers):
            self.supervisor.start(Managed(f"worker{rank}", f"worker{rank}", lambda attempt, r=rank: [
                "ps-worker", *self._common(attempt), "--servers", ",".join(addresses), "--rank", str(r),
                "--worker-id", f"worker{r}"]))

    def _start_coordinator(self, registry: Path) -> str:
        bind = [f"{self.config.ps.bind_host}:0"]
        faults = [f"--inject={format_fault(fault)}" for fault in self.options.faults
                  if fault.role == "coordinator"]

        def args(attempt: int) -> list[str]:
            return ["coordinator", "--bind", bind[0], "--registry", str(registry),
                    "--config", str(self.config_path), *faults, "--attempt", str(attempt),
                    *self.options.tls.args()]

        self.supervisor.start(Managed("coordinator", "coordinator", args))
        bind[0] = self._wait_listening("coordinator")  # a restart binds the same port
        logger.info("coordinator listening on %s (registry %s)", bind[0], registry)
        return bind[0]

    def _start_server(self, shard: int) -> str:
        name, bind = f"server{shard}", [f"{self.config.ps.bind_host}:0"]
        self.supervisor.start(Managed(name, name, lambda attempt: [
            "ps-server", *self._common(attempt), "--bind", bind[0],
            "--shard", f"{shard}/{self.config.ps.num_servers}"]))
        self._binds[name] = bind
        return name

    def _wait_listening(self, name: str) -> str:
        """The address `name` reports it listens on (a restart binds the same).

        Raises:
            DistributedError: it exited, or did not report in time.
        """
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while name not in self._listening:
            event = self.cluster.next_event(max(0.0, deadline - time.monotonic()))
            if event is None:
                raise DistributedError(f"{name} did not start within {STARTUP_TIMEOUT_S:.0f}s; see "
                                       f"{self.cluster.log_dir}/{name}.log")
            if event.kind == "listening":
                self._listening[event.child] = str(event.fields["address"])
            elif event.kind == "exit":
                self.supervisor.exited(event.child, int(event.fields["code"]))
            else:
                self._early.append(event)
        address = self._listening[name]
        if name in self._binds:
            self._binds[name][0] = address
        return address

    def _report_exit(self, node_id: str, code: int, reason: str) -> None:
        """Tell the coordinator at once; while it is down (it is being restarted), keep the
        news for when it is back."""
        if self.coordinator is None or node_id == "coordinator":
            return
        self._unreported.append((node_id, code, reason))
        try:
            self._deliver_reports()
        except CoordinatorError as e:
            logger.info("the coordinator will hear that %s %s once it is back (%s)", node_id, reason, e)

    def _deliver_reports(self) -> None:
        while self._unreported:
            self.coordinator.report_exit(*self._unreported[0])
            self._unreported.pop(0)

    def _deliver_reports_patiently(self) -> None:
        """Make sure the coordinator's registry ends with every exit (it may be restarting)."""
        if not self._unreported or self.coordinator is None:
            return
        try:
            tenacity.Retrying(retry=tenacity.retry_if_exception_type(CoordinatorError),
                              wait=tenacity.wait_exponential_jitter(initial=0.1, max=2.0),
                              stop=tenacity.stop_after_delay(STARTUP_TIMEOUT_S), reraise=True)(
                self._deliver_reports)
        except CoordinatorError as e:
            logger.warning("the coordinator's registry misses how %d process(es) ended: %s",
                           len(self._unreported), e)

    def supervise(self) -> None:
        """Show progress until every worker is done and the servers stopped; restart what fails."""
        watch = ClusterWatch(self.config.system.num_workers, f"ps-{self.config.ps.aggregation_mode}")
        running = {name for name in self.supervisor.processes if name != "coordinator"}
        events = list(self._early)
        deadline = None
        while running:
            event = events.pop(0) if events else self.cluster.next_event(
                None if deadline is None else max(0.0, deadline - time.monotonic()))
            if event is None:  # the work is done (worker 0 wrote the model): stop what is left
                logger.warning("%s still running %.0fs after the workers finished; stopping them",
                               ", ".join(sorted(running)), SHUTDOWN_TIMEOUT_S)
                break
            if event.kind == "node-failed":
                fields = event.fields
                self.supervisor.declared_failed(str(fields["node"]), str(fields.get("reason")),
                                                int(fields.get("pid", 0)))
            elif event.kind == "exit":
                code = int(event.fields["code"])
                if deadline is None and event.child.startswith("server") and code == 0:
                    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S  # worker 0 stopped the servers
                if deadline is not None and event.child != "coordinator":  # nothing left to restart for
                    running.discard(event.child)
                elif self.supervisor.exited(event.child, code) or event.child == "coordinator":
                    continue
                running.discard(event.child)
                if event.child.startswith("worker") and watch.worker_done():
                    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            else:
                watch.saw(event)
        watch.close()
        self._deliver_reports_patiently()
        if self.coordinator is not None:
            self.coordinator.close()
