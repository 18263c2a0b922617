"""`disttrain ps-worker`."""

from __future__ import annotations

import argparse
import os
import socket

from disttrain.cli.flags import (
    add_tls_flags,
    add_token_flag,
    add_training_flags,
    config_from_args,
    options_from_args,
)
from disttrain.cli.ps import COORDINATOR_FLAG, PS_FLAGS
from disttrain.core.addresses import parse_address_list
from disttrain.metrics.summary import RunSummary
from disttrain.strategies.ps.worker import run_worker

HELP = "train as one parameter-server worker"
DESCRIPTION = """Train as one worker of a parameter-server run whose servers are already up (on
this machine or others). Worker 0 also writes the final model and summary.json and
stops the servers when every worker is done. A worker killed mid-run continues from its
own checkpoint with --resume (same --worker-id and --rank); the servers apply each of
its steps once.

    disttrain ps-worker --servers hostA:50051,hostA:50052 --config ps.yaml
    disttrain ps-worker --servers hostA:50051 --rank 1 --worker-id worker1 --resume
    disttrain ps-worker --servers hostA:50051 --coordinator hostC:50050 --worker-id worker0"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, {**PS_FLAGS, **COORDINATOR_FLAG})
    add_token_flag(parser)
    add_tls_flags(parser)
    parser.add_argument("--servers", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                        help="every shard's server, in shard order")
    parser.add_argument("--worker-id", default=None,
                        help="this worker's name (default: host:pid); a restarted worker reuses its name")
    parser.add_argument("--rank", type=int, default=-1,
                        help="ask for this rank (default: the servers assign the lowest free one)")


def run(args: argparse.Namespace) -> RunSummary | None:
    config = config_from_args(args)
    servers = parse_address_list(args.servers, "--servers")
    worker_id = args.worker_id or f"{socket.gethostname()}:{os.getpid()}"
    return run_worker(config, servers, worker_id, args.rank, options_from_args(args))
