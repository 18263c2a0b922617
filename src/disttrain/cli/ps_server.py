"""`disttrain ps-server`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from disttrain.cli.check import add_check_flag, describe_coordinator, describe_security
from disttrain.cli.config_warnings import warn_about_run_config
from disttrain.cli.flags import (
    add_attempt_flag,
    add_common_flags,
    add_config_flags,
    add_fault_flags,
    add_insecure_flag,
    add_tls_flags,
    add_token_flag,
    check_exposure,
    config_from_args,
    options_from_args,
)
from disttrain.cli.ps import COORDINATOR_FLAG, PS_FLAGS, describe_ps_run
from disttrain.config import Config
from disttrain.core.errors import ConfigError
from disttrain.core.process_spec import FLAGS
from disttrain.training.options import RunOptions

HELP = "serve one parameter-server shard over gRPC"
DESCRIPTION = """Serve one shard of the model's parameters over gRPC, for runs across machines.
Start one per shard, all with the same config, then start the workers with their
addresses. With --coordinator it registers and heartbeats there, and a synchronous step
stops waiting for a worker the coordinator declared failed. Stops on Ctrl-C, or once
every worker is done, after a final checkpoint under <checkpoint_dir>/server<I>/.

    disttrain ps-server --bind 0.0.0.0:50051 --shard 0/2 --config ps.yaml --token-file run.token
    disttrain ps-server --bind 0.0.0.0:50051 --shard 0/2 --config ps.yaml --token-file run.token --resume
    disttrain ps-server --bind 0.0.0.0:50051 --shard 0/1 --coordinator hostC:50050 --token-file run.token

A bind other machines reach needs the run's token (`disttrain token new`) or client
certificates (`disttrain tls new`), or --insecure."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_flags(parser)
    add_check_flag(parser)
    add_config_flags(parser, {"--workers": ("system.num_workers", int, "workers of the run"),
                              **PS_FLAGS, **COORDINATOR_FLAG})
    parser.add_argument(FLAGS.bind, default=None, metavar="HOST:PORT",
                        help="address to listen on (default: ps.bind_host with a free port)")
    parser.add_argument(FLAGS.shard, default="0/1", metavar="I/S",
                        help="which shard this server holds, of how many (default 0/1)")
    parser.add_argument(FLAGS.resume, action="store_true",
                        help="start from this shard's newest checkpoint")
    add_fault_flags(parser)
    add_attempt_flag(parser)
    add_token_flag(parser)
    add_tls_flags(parser)
    add_insecure_flag(parser)


def parse_shard(text: str) -> tuple[int, int]:
    """Split "I/S" into (shard index, number of shards).

    Raises:
        ConfigError: not of that form, or I outside [0, S).
    """
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 0 <= int(index) < int(count):
        raise ConfigError(f"--shard {text!r} must look like I/S with 0 <= I < S, e.g. 0/2")
    return int(index), int(count)


@dataclass(frozen=True)
class ServerPlan:
    """What `ps-server` serves, checked."""

    config: Config
    options: RunOptions
    bind: str
    shard: int
    num_shards: int


def prepare(args: argparse.Namespace) -> ServerPlan:
    """Raises ConfigError for a bad config, --shard, --bind, token or TLS file; warns
    about keys the run ignores (started by hand)."""
    config = config_from_args(args)
    warn_about_run_config(config, "ps-server")
    shard, num_shards = parse_shard(args.shard)
    bind = args.bind or f"{config.ps.bind_host}:0"
    options = options_from_args(args)
    check_exposure(args, bind, "--bind", "the shard server would be reachable from other machines", options)
    return ServerPlan(config, options, bind, shard, num_shards)


def check(args: argparse.Namespace) -> str:
    from disttrain.strategies.ps.run.launcher import check_supported
    plan = prepare(args)
    check_supported(plan.config)
    resume = ", resuming" if plan.options.resume else ""
    return (f"shard {plan.shard}/{plan.num_shards} of {describe_ps_run(plan.config)}, listening on "
            f"{plan.bind}, {describe_coordinator(plan.config)}{describe_security(plan.options)}; "
            f"checkpoints in {plan.config.system.checkpoint_dir}/server{plan.shard}{resume}")


def run(args: argparse.Namespace) -> None:
    from disttrain.strategies.ps.run.server import serve
    plan = prepare(args)
    serve(plan.config, plan.bind, plan.shard, plan.num_shards, plan.options)
