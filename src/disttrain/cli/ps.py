"""`disttrain ps`."""

from __future__ import annotations

import argparse

from disttrain.cli.flags import (
    COMPRESSION_FLAGS,
    add_training_flags,
    config_from_args,
    not_used_yet_epilog,
    options_from_args,
)
from disttrain.metrics.summary import RunSummary
from disttrain.strategies.ps import STRATEGY

HELP = "parameter server: servers and workers on this machine"
DESCRIPTION = """Train with a parameter server on this machine: start the shard servers on free
ports and the workers, show one progress display, and stop everything on Ctrl-C or as
soon as a process fails. Each process logs to <log_dir>/<name>.log; worker 0 writes the
final model (parameter_server_final.pt) and summary.json.

    disttrain ps --workers 2 --dataset mnist --num-epochs 2
    disttrain ps --workers 4 --servers 2 --aggregation-mode ssp --staleness 2
    disttrain ps --workers 2 --aggregation-mode async --compression-enabled \\
        --compression-type topk --compression-ratio 0.01"""
EPILOG = not_used_yet_epilog()

# flag -> (config key, type, help): the parameter server's knobs (ps-server and
# ps-worker take them too).
PS_FLAGS = {
    "--aggregation-mode": ("ps.aggregation_mode", str, "sync, async or ssp"),
    "--staleness": ("ps.staleness", int, "ssp: the staleness bound"),
    "--backup-workers": ("ps.backup_workers", int, "sync: apply each step without the last N gradients"),
    "--rpc-timeout": ("ps.rpc_timeout_s", float, "deadline of each RPC (s)"),
    **COMPRESSION_FLAGS,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, {
        "--workers": ("system.num_workers", int, "worker processes"),
        "--servers": ("ps.num_servers", int, "parameter-server shards"),
        "--bind-host": ("ps.bind_host", str, "address the servers listen on"),
        **PS_FLAGS,
    })


def run(args: argparse.Namespace) -> RunSummary:
    return STRATEGY.run(config_from_args(args), options_from_args(args))
