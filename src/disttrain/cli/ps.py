"""`disttrain ps`."""

from __future__ import annotations

import argparse

from disttrain.cli.check import (
    count,
    describe_aggregation,
    describe_compression,
    describe_coordinator,
    describe_folders,
    describe_security,
    describe_training,
)
from disttrain.cli.flags import (
    COMPRESSION_FLAGS,
    LOCAL_UPDATE_FLAGS,
    add_tls_flags,
    add_token_flag,
    add_training_flags,
    balance_flags,
    prepare_run,
    size_arg,
    split_size_range,
)
from disttrain.config import Config
from disttrain.metrics.summary import RunSummary
from disttrain.training.options import RunOptions

HELP = "parameter server: servers and workers on this machine"
DESCRIPTION = """Train with a parameter server on this machine: start a coordinator, the shard
servers on free ports and the workers, and show one progress display. Every process
heartbeats to the coordinator; one that dies or hangs is restarted where it left off
(for free when it had made progress, else up to --max-restarts times in a row; a
user's error stops the run at once) while the others train on, and no sample is lost or
applied twice. A worker away for longer than --reassign-after seconds has its blocks
taken over by the others (it takes back what is left if it returns), so a worker past
its restarts no longer stops the run. Watch it with `disttrain status --registry <log_dir>/cluster.db`. Each
process logs to <log_dir>/<name>.log; worker 0 writes the final model
(parameter_server_final.pt) and summary.json, with every failure and its recovery.

    disttrain ps --workers 2 --dataset mnist --num-epochs 2
    disttrain ps --workers 2 --inject kill:worker=1:step=30 --inject kill:server=0:step=40
    disttrain ps --workers 4 --servers 2 --aggregation-mode ssp --staleness 2
    disttrain ps --workers 2:4 --aggregation-mode async    # kill -USR1 <launcher> grows it by one
    disttrain ps --workers 2 --aggregation-mode async --compression-enabled \\
        --compression-type topk --compression-ratio 0.01"""

# flag -> (config key, type, help): the parameter server's knobs (ps-server and
# ps-worker take them too).
PS_FLAGS = {
    "--aggregation-mode": ("ps.aggregation_mode", str, "sync, async or ssp"),
    "--staleness": ("ps.staleness", int, "ssp: the staleness bound"),
    "--backup-workers": ("ps.backup_workers", int, "sync: apply each step without the last N gradients"),
    "--no-overlap": ("ps.overlap", False, "sync: push the gradients after the backward pass, not each "
                     "shard's as soon as backward has produced it"),
    "--rpc-timeout": ("ps.rpc_timeout_s", float, "deadline of each RPC (s)"),
    **balance_flags("worker"),
    "--heartbeat-interval": ("coordinator.heartbeat_interval", float, "seconds between heartbeats"),
    "--heartbeat-timeout": ("coordinator.heartbeat_timeout", float,
                            "seconds without a heartbeat before a process is declared failed"),
    "--reassign-after": ("coordinator.reassign_after", float,
                         "seconds a failed worker may stay away before its blocks of the epoch go to the "
                         "other workers (it takes back what is left if it rejoins)"),
    **COMPRESSION_FLAGS,
    **LOCAL_UPDATE_FLAGS,
}


# The coordinator of a run across machines (`disttrain coordinator`).
COORDINATOR_FLAG = {"--coordinator": ("coordinator.address", str, "HOST:PORT of the run's coordinator: "
                                      "register there, heartbeat, follow its membership")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, {
        "--workers": ("system.num_workers", size_arg, "worker processes; MIN:MAX: a run that starts MIN "
                      "workers, shrinks by one when a worker is sent SIGTERM (down to MIN) and grows by one "
                      "on SIGUSR1 to this launcher (up to MAX, ps.max_workers), each through a checkpoint"),
        "--servers": ("ps.num_servers", int, "parameter-server shards"),
        "--bind-host": ("ps.bind_host", str, "address the servers listen on"),
        "--max-restarts": ("coordinator.max_restarts", int, "restarts of one process in a row "
                           "without progress before the run stops (one that died after progress "
                           "is restarted for free); 0: no restarts"),
        "--spares": ("ps.spares", int, "hot spares: worker processes started ahead that wait; a lost "
                     "worker is restarted on one instead of a fresh process, and a new spare started"),
        **PS_FLAGS,
    })
    add_token_flag(parser)
    add_tls_flags(parser)


def prepare(args: argparse.Namespace) -> tuple[Config, RunOptions]:
    """The run's config and options, checked (a ConfigError otherwise); warns about keys
    the run ignores. `--workers MIN:MAX` is split into its keys first."""
    split_size_range(args, "--workers", "ps.max_workers")
    return prepare_run(args, "ps")


def describe_ps_run(config: Config) -> str:
    """E.g. "a sync run for 2 workers"."""
    workers = count(config.system.num_workers, "worker")
    if config.ps.max_workers:
        workers = f"{config.system.num_workers} to {config.ps.max_workers} workers (elastic)"
    return f"a {describe_aggregation(config)} run for {workers}"


def check(args: argparse.Namespace) -> str:
    from disttrain.strategies.ps.run.launcher import check_supported
    from disttrain.training.first_step import dry_run_step
    config, options = prepare(args)
    check_supported(config)
    step = dry_run_step(config.training)
    coordinator = describe_coordinator(config, "with its own coordinator")
    return (f"{describe_ps_run(config)} with {count(config.ps.num_servers, 'server shard')} on "
            f"{config.ps.bind_host}, {coordinator}{describe_security(options)}; "
            f"{describe_training(config)}{describe_compression(config)} ({step}); "
            f"{describe_folders(config, options)}")


def run(args: argparse.Namespace) -> RunSummary:
    from disttrain.strategies.ps import STRATEGY
    return STRATEGY.run(*prepare(args))
