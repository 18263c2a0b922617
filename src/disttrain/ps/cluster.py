"""`disttrain ps`: a whole parameter-server run on this machine.

Starts `system.num_servers` shard servers on free ports (each reports the port it bound),
then `system.num_workers` workers pointed at them; shows one progress display for the
cluster; streams every process's output to `<log_dir>/<name>.log`; stops everything on
Ctrl-C or as soon as any process fails. Worker 0 writes `parameter_server_final.pt` and
`summary.json` (strategy ps-sync, ps-ssp or ps-async) when every worker is done.

    disttrain ps --workers 2 --dataset mnist --num-epochs 2
    disttrain ps --workers 4 --servers 2 --aggregation-mode ssp --staleness 2
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from disttrain import cli
from disttrain.config import Config
from disttrain.errors import ConfigError, DistributedError
from disttrain.faults import Fault
from disttrain.launch import Cluster, raise_on_sigterm
from disttrain.metrics import SUMMARY_FILE, Progress, RunSummary
from disttrain.ps.model import check_supported

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 60.0


def run_cluster(config: Config, summary_json: str | None = None, verbose: bool = False,
                extra_worker_args: list[str] | None = None) -> RunSummary:
    """Run servers and workers as child processes until the run ends.

    Raises:
        DistributedError: a process failed (its name, exit code and log are named).
    """
    check_supported(config)
    system = config.system
    system.architecture = "parameter_server"
    log_dir = Path(system.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / SUMMARY_FILE).unlink(missing_ok=True)
    config_path = log_dir / "config.yaml"
    config.save(config_path)
    common = ["--config", str(config_path)] + (["-v"] if verbose else [])
    raise_on_sigterm()
    with Cluster(log_dir) as cluster:
        addresses = start_servers(cluster, common, system.bind_host, system.num_servers)
        logger.info("servers listening on %s", ", ".join(addresses))
        for rank in range(system.num_workers):
            args = ["ps-worker", *common, "--servers", ",".join(addresses), "--rank", str(rank),
                    "--worker-id", f"worker{rank}", *(extra_worker_args or [])]
            if rank == 0 and summary_json:
                args += ["--summary-json", str(summary_json)]
            cluster.spawn(f"worker{rank}", args)
        _supervise(cluster, system.num_workers, f"ps-{system.aggregation_mode}")
    return _read_summary(log_dir / SUMMARY_FILE)


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
            if len(plans) == num_workers:
                progress = Progress(sum(plans.values()), description, initial=steps)
        elif event.kind == "progress":
            steps += 1
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


def _read_summary(path: Path) -> RunSummary:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DistributedError(f"worker 0 did not write the run summary {path}: {e}") from e
    names = [name for name in RunSummary.__dataclass_fields__ if name != "extra" and name in data]
    fields = {name: data.pop(name) for name in names}
    return RunSummary(**fields, extra=data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli.add_config_flag(parser, "--workers", "system.num_workers", int, "worker processes")
    cli.add_config_flag(parser, "--servers", "system.num_servers", int, "parameter-server shards")
    cli.add_config_flag(parser, "--aggregation-mode", "system.aggregation_mode", str, "sync, async or ssp")
    cli.add_config_flag(parser, "--staleness", "system.staleness", int, "ssp staleness bound")
    cli.add_config_flag(parser, "--backup-workers", "system.backup_workers", int,
                        "sync: apply each step without the last N gradients")
    cli.add_config_flag(parser, "--rpc-timeout", "system.rpc_timeout_s", float, "deadline of each RPC (s)")
    cli.add_config_flag(parser, "--bind-host", "system.bind_host", str, "address the servers listen on")


def main(args: argparse.Namespace, config: Config) -> RunSummary:
    if args.resume:
        raise ConfigError("--resume: the ps launcher cannot resume a run yet; restart a server from its "
                          "checkpoints with `disttrain ps-server --resume`")
    return run_cluster(config, args.summary_json, args.verbose, [_fault_flag(f) for f in args.faults])


def _fault_flag(fault: Fault) -> str:
    """The `--inject-fault` argument that names `fault` again, for the workers."""
    rank = "" if fault.rank is None else f",rank={fault.rank}"
    return f"--inject-fault={fault.action}@step={fault.step}{rank},attempt={fault.attempt}"
