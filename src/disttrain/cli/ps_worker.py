"""`disttrain ps-worker`."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from disttrain.cli.check import (
    describe_compression,
    describe_coordinator,
    describe_security,
    describe_training,
)
from disttrain.cli.config_warnings import warn_about_run_config
from disttrain.cli.flags import (
    add_tls_flags,
    add_token_flag,
    add_training_flags,
    config_from_args,
    options_from_args,
)
from disttrain.cli.ps import COORDINATOR_FLAG, PS_FLAGS, describe_ps_run
from disttrain.config import Config
from disttrain.core.addresses import parse_address_list
from disttrain.core.identity import named_in
from disttrain.core.process_spec import FLAGS
from disttrain.metrics.summary import RunSummary
from disttrain.training.options import RunOptions

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
    parser.add_argument(FLAGS.servers, required=True, metavar="HOST:PORT[,HOST:PORT...]",
                        help="every shard's server, in shard order")
    parser.add_argument(FLAGS.worker_id, default=None,
                        help="this worker's name (default: host:pid); a restarted worker reuses its name")
    parser.add_argument(FLAGS.rank, type=int, default=-1,
                        help="ask for this rank (default: the servers assign the lowest free one)")
    parser.add_argument(FLAGS.handoff, type=Path, default=None, metavar="FILE",
                        help="start as a hot spare of `disttrain ps` (which passes it): start up, then wait "
                             "for SIGUSR1 and this file naming the lost worker to become")


@dataclass(frozen=True)
class WorkerPlan:
    """What `ps-worker` trains as, checked."""

    config: Config
    options: RunOptions
    servers: list[str]
    worker_id: str


def prepare(args: argparse.Namespace) -> WorkerPlan:
    """Raises ConfigError for a bad config, --servers, token or TLS file; warns about
    keys the run ignores (started by hand)."""
    config = config_from_args(args)
    warn_about_run_config(config, "ps-worker")
    servers = parse_address_list(args.servers, "--servers")
    options = options_from_args(args)
    # A worker holding a node token is that node (the servers refuse it any other name).
    named = named_in(options.token) if options.token else None
    worker_id = args.worker_id or (named.node_id if named else f"{socket.gethostname()}:{os.getpid()}")
    return WorkerPlan(config, options, servers, worker_id)


def check(args: argparse.Namespace) -> str:
    from disttrain.strategies.ps.run.launcher import check_supported
    from disttrain.training.models import init_model
    plan = prepare(args)
    check_supported(plan.config)
    init_model(plan.config.training)
    rank = f"rank {args.rank}" if args.rank >= 0 else "the rank the servers assign"
    named = (f"worker {plan.worker_id}" if not plan.worker_id.endswith(f":{os.getpid()}")
             else "a worker named host:pid")
    return (f"{named}, {rank}, of {describe_ps_run(plan.config)}, pushing to "
            f"{','.join(plan.servers)}, {describe_coordinator(plan.config)}"
            f"{describe_security(plan.options)}; {describe_training(plan.config)}"
            f"{describe_compression(plan.config)}")


def run(args: argparse.Namespace) -> RunSummary | None:
    from disttrain.strategies.ps.run.worker import run_worker
    plan = prepare(args)
    return run_worker(plan.config, plan.servers, plan.worker_id, args.rank, plan.options, args.spare_handoff)
