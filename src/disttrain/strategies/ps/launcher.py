"""The `ps` strategy: a whole parameter-server run on this machine.

Starts `ps.num_servers` shard servers on free ports (each reports the port it bound),
then `system.num_workers` workers pointed at them; shows one progress display for the
cluster; streams every process's output to `<log_dir>/<name>.log`; stops everything on
Ctrl-C or as soon as any process fails. Worker 0 writes `parameter_server_final.pt` and
`summary.json` (strategy ps-sync, ps-ssp or ps-async) when every worker is done.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from disttrain.config import Config
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import ConfigError, DistributedError
from disttrain.core.faults import format_fault
from disttrain.core.processes import Cluster, raise_on_sigterm
from disttrain.metrics.progress import Progress
from disttrain.metrics.summary import SUMMARY_FILE, RunSummary
from disttrain.strategies.ps.model import check_supported
from disttrain.training.models import init_model
from disttrain.training.strategy import RunOptions

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 60.0


def run_cluster(config: Config, options: RunOptions) -> RunSummary:
    """Run servers and workers as child processes until the run ends.

    Raises:
        ConfigError: bad input found before any process starts (compression asked for,
            an unknown model, `--resume`, checkpoints of an earlier run in the folder).
        DistributedError: a process failed (its name, exit code and log are named).
    """
    started = time.perf_counter()
    preflight(config, options)
    system, ps = config.system, config.ps
    log_dir = Path(system.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / SUMMARY_FILE).unlink(missing_ok=True)
    config_path = log_dir / "config.yaml"
    config.save(config_path)
    common = ["--config", str(config_path)] + (["-v"] if options.verbose else [])
    faults = [f"--inject-fault={format_fault(fault)}" for fault in options.faults]
    raise_on_sigterm()
    with Cluster(log_dir) as cluster:
        addresses = start_servers(cluster, common, ps.bind_host, ps.num_servers)
        logger.info("servers listening on %s", ", ".join(addresses))
        for rank in range(system.num_workers):
            cluster.spawn(f"worker{rank}", ["ps-worker", *common, "--servers", ",".join(addresses),
                                            "--rank", str(rank), "--worker-id", f"worker{rank}", *faults])
        _supervise(cluster, system.num_workers, f"ps-{ps.aggregation_mode}")
    try:
        summary = RunSummary.read(log_dir / SUMMARY_FILE)
    except (OSError, ValueError) as e:
        raise DistributedError(f"worker 0 did not write the run summary in {log_dir}: {e}") from e
    summary.total_time_s = time.perf_counter() - started  # the whole command, start-up included
    summary.write(log_dir)
    return summary


def preflight(config: Config, options: RunOptions) -> None:
    """What can be checked before starting processes.

    Raises:
        ConfigError: see `run_cluster`.
    """
    check_supported(config)
    init_model(config.training)  # an unknown model or data set fails here, once
    if options.resume:
        raise ConfigError("--resume: the ps launcher cannot resume a run yet; restart a server with "
                          "`disttrain ps-server --resume` and a worker with `disttrain ps-worker --resume`")
    folder = Path(config.system.checkpoint_dir)
    for name in [f"server{s}" for s in range(config.ps.num_servers)] + \
            [f"worker{r}" for r in range(config.system.num_workers)]:
        ckpt.prepare_checkpoint_dir(folder / name, resume=False)


class ParameterServer:
    name = "ps"

    def run(self, config: Config, options: RunOptions) -> RunSummary:
        return run_cluster(config, options)


STRATEGY = ParameterServer()


def start_servers(cluster: Cluster, args: list[str], bind_host: str, num_servers: int) -> list[str]:
    """Start `num_servers` shard servers on free ports; return their addresses in shard order.

    Args:
        args: extra arguments of every server (`--config PATH`, ...).
    Raises:
        DistributedError: a server exited, or none reported its address in time.
    """
    for shard in range(num_servers):
        cluster.spawn(f"server{shard}", ["ps-server", *args, "--bind", f"{bind_host}:0",
                                         "--shard", f"{shard}/{num_servers}"])
    addresses: dict[int, str] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(addresses) < num_servers:
        event = cluster.next_event(max(0.0, deadline - time.monotonic()))
        if event is None:
            raise DistributedError(f"servers did not start within {STARTUP_TIMEOUT_S:.0f}s; see "
                                   f"{cluster.log_dir}/server*.log")
        if event.kind == "listening":
            addresses[int(event.fields["shard"])] = str(event.fields["address"])
        elif event.kind == "exit":
            _fail(cluster, event.child, event.fields["code"])
    return [addresses[s] for s in range(num_servers)]


def _supervise(cluster: Cluster, num_workers: int, description: str) -> None:
    """Show progress until every child has exited cleanly; fail on the first that does not."""
    plans: dict[str, int] = {}
    steps = 0
    progress: Progress | None = None
    running = set(cluster.children)
    workers_left = num_workers
    shutdown_deadline = None
    while running:
        timeout = None if shutdown_deadline is None else max(0.0, shutdown_deadline - time.monotonic())
        event = cluster.next_event(timeout)
        if event is None:
            raise DistributedError(f"servers still running {SHUTDOWN_TIMEOUT_S:.0f}s after the workers "
                                   f"finished: {', '.join(sorted(running))}")
        if event.kind == "plan":
            plans[event.child] = int(event.fields["total_steps"])
            steps += int(event.fields.get("done_steps", 0))
            if len(plans) == num_workers:
                progress = Progress(sum(plans.values()), description, initial=steps)
        elif event.kind == "progress":
            steps += int(event.fields.get("steps", 1))
            if progress is not None:
                progress.update(1, loss=float(event.fields.get("loss", 0.0)))
        elif event.kind == "exit":
            running.discard(event.child)
            if event.fields["code"] != 0:
                _fail(cluster, event.child, event.fields["code"])
            if event.child.startswith("worker"):
                workers_left -= 1
                if workers_left == 0:
                    shutdown_deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    if progress is not None:
        progress.close()


def _fail(cluster: Cluster, name: str, code: int) -> None:
    child = cluster.children[name]
    tail = child.tail(3).replace("\n", " | ")
    raise DistributedError(f"{name} exited with code {code}; the cluster was stopped. Its log "
                           f"{child.log_path} ends: {tail}")
