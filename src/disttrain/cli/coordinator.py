"""`disttrain coordinator`."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from disttrain.cli.check import add_check_flag, describe_security
from disttrain.cli.flags import (
    CONFIG_HELP,
    add_attempt_flag,
    add_fault_flags,
    add_insecure_flag,
    add_tls_flags,
    add_token_flag,
    check_exposure,
    faults_from_args,
    tls_from_args,
    token_from_args,
)
from disttrain.config import Config, load_config
from disttrain.coordinator.launch import REGISTRY_FILE
from disttrain.coordinator.service import CoordinatorHooks, CoordinatorServer
from disttrain.core.faults import FaultInjector
from disttrain.core.process_spec import FLAGS
from disttrain.core.processes import ProgressReport, bind_to_parent, emit_event
from disttrain.training.options import RunOptions

logger = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:50050"  # this machine only, unless told otherwise

HELP = "track the processes of a run: membership, heartbeats, failures, stragglers"
DESCRIPTION = f"""Track every process of a run: who joined, who is alive (heartbeats), who failed
and was restarted, and how fast each one goes. Processes find it through
coordinator.address in their config (--set coordinator.address=HOST:PORT). Its state is
kept in a SQLite file (--registry): a coordinator restarted on the same file shows the
cluster as it was, and `disttrain status --registry FILE` reads the file even while no
coordinator runs. It listens on this machine only unless --bind says otherwise, and then
only with the run's token or client certificates (or --insecure). Stops on Ctrl-C or SIGTERM.

    disttrain token new run.token
    disttrain coordinator --bind 0.0.0.0:50050 --token-file run.token --registry runs/{REGISTRY_FILE}
    disttrain coordinator --registry runs/{REGISTRY_FILE} --set coordinator.heartbeat_timeout=10
    disttrain coordinator --registry runs/{REGISTRY_FILE} --inject kill:coordinator:step=20
    disttrain status --coordinator node0:50050"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAGS.bind, default=None, metavar="HOST:PORT",
                        help=f"address to listen on; port 0 picks a free one (default: "
                             f"coordinator.address, else {DEFAULT_BIND})")
    parser.add_argument(FLAGS.registry, default=None, metavar="PATH",
                        help=f"SQLite file holding the cluster's state, created when absent "
                             f"(default: <system.log_dir>/{REGISTRY_FILE})")
    parser.add_argument(FLAGS.config, help=f"{CONFIG_HELP} (its coordinator section is used)")
    parser.add_argument(FLAGS.setting, action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key, e.g. coordinator.heartbeat_timeout=10 (repeatable)")
    parser.add_argument(FLAGS.verbose, "--verbose", action="store_true", help="debug logging")
    add_fault_flags(parser)  # its faults fire at the highest step any node reported
    add_attempt_flag(parser)
    add_token_flag(parser)
    add_tls_flags(parser)
    add_insecure_flag(parser)
    add_check_flag(parser)


@dataclass(frozen=True)
class CoordinatorPlan:
    """What `coordinator` serves, checked."""

    config: Config
    options: RunOptions
    bind: str
    registry: str


def prepare(args: argparse.Namespace) -> CoordinatorPlan:
    """Raises ConfigError for a bad config, --bind, token or TLS file."""
    options = RunOptions(faults=faults_from_args(args), attempt=args.attempt, token=token_from_args(args),
                         tls=tls_from_args(args))
    config = load_config(args.config, {}, args.set)
    bind = args.bind or config.coordinator.address or DEFAULT_BIND
    check_exposure(args, bind, "--bind", "the coordinator would be reachable from other machines", options)
    registry = args.registry or str(Path(config.system.log_dir) / REGISTRY_FILE)
    return CoordinatorPlan(config, options, bind, registry)


def check(args: argparse.Namespace) -> str:
    plan = prepare(args)
    settings = plan.config.coordinator
    return (f"listening on {plan.bind}{describe_security(plan.options)}, registry {plan.registry}, "
            f"heartbeats every {settings.heartbeat_interval:g}s, a process failed after "
            f"{settings.heartbeat_timeout:g}s without one")


def run(args: argparse.Namespace) -> None:
    bind_to_parent()
    plan = prepare(args)
    bind, registry = plan.bind, plan.registry
    faults = FaultInjector(plan.options.faults, "coordinator", 0, plan.options.attempt)
    progress = ProgressReport()  # the furthest step heard of, for the launcher's restart budget
    on_step = (lambda step: (progress(step), faults.at_step(step))) if faults.faults else progress
    server = CoordinatorServer(plan.config.coordinator, bind, registry, CoordinatorHooks(on_step=on_step),
                               credentials=plan.options.credentials)
    server.on_failure = lambda node_id, reason: _announce_failure(server, node_id, reason)
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    logger.info("coordinator listening on %s (registry %s)", server.address, registry)
    emit_event("listening", address=server.address, registry=registry)
    try:
        stopped.wait()
    finally:
        server.stop()
        logger.info("coordinator stopped")


def _announce_failure(server: CoordinatorServer, node_id: str, reason: str) -> None:
    """Tell a launcher that a node missed its heartbeats, so it can restart it (the pid
    names the process: a launcher leaves a newer process of the same node alone)."""
    node = server.state.membership.get(node_id)
    emit_event("node-failed", node=node_id, reason=reason, pid=node.pid if node is not None else 0)
