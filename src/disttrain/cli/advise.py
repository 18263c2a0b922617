"""`disttrain advise`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from disttrain.cli.flags import (
    COMPRESSION_FLAGS,
    add_common_flags,
    add_config_flags,
    add_insecure_flag,
    add_token_flag,
    config_from_args,
    token_from_args,
)
from disttrain.core.addresses import parse_address
from disttrain.core.errors import ConfigError
from disttrain.core.rpc_server import require_credentials
from disttrain.core.tls import TlsFiles

if TYPE_CHECKING:
    from disttrain.report.advice import Advisor

HELP = "predict which strategy, shards and compression win on a bigger cluster"
DESCRIPTION = """Measure one worker's step on this machine (or take --step-time) and each
compressor's cost on the model's gradients, take the link (--link, --peer, or this
machine's loopback), and predict with an alpha-beta cost model the samples/s, scaling
efficiency and bytes per step of DDP and the parameter server (sync, async; 1 to 64
shards; each compression; local updates every H steps) from 1 to 1,024 workers. Each row
names the fastest configuration and the cheapest within 10% of it. --simulate N replays
the parameter server's own aggregation rules in virtual time (sync, backup workers,
SSP, async) with stragglers, a log-normal tail and failures, and the fastest
configuration with local updates (Streaming DiLoCo's fragments and delay) step by step.

    disttrain advise --model resnet18 --dataset cifar10 --link 1gbit,0.2ms
    disttrain advise --config example --step-time 0.12 --link 10gbit,50us --json
    disttrain advise --model resnet18 --dataset synthetic:3x32x32 --simulate 64 --stragglers 0.05
    disttrain advise --serve --bind 0.0.0.0:50070     (on the other machine)
    disttrain advise --model simplecnn --peer hostB:50070"""


def _counts(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{what}: give positive integers separated by commas, e.g. 1,8")
    return values


# What shapes a step: the model, its data's shapes, the batch, the optimizer, the threads.
STEP_FLAGS = ("--dataset", "--data-dir", "--batch-size", "--optimizer", "--model", "--seq-len",
              "--num-threads", "--seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_flags(parser, only=STEP_FLAGS)
    add_config_flags(parser, {"--compression-ratio": COMPRESSION_FLAGS["--compression-ratio"]})
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--link", metavar="BANDWIDTH,LATENCY",
                      help="the cluster's link, e.g. 1gbit,0.2ms or 10gbit,50us (kbit, mbit or gbit; "
                           "us, ms or s); default: measure this machine's loopback")
    link.add_argument("--peer", metavar="HOST:PORT",
                      help="measure bandwidth and round trip to a `disttrain advise --serve` there")
    parser.add_argument("--step-time", type=float, metavar="S",
                        help="seconds of one worker's forward+backward on the cluster's device "
                             "(default: measured here at the configured batch)")
    parser.add_argument("--step-time-cv", type=float, default=0.0, metavar="CV",
                        help="spread of step times across workers (coefficient of variation): a "
                             "synchronous step waits for the slowest of n")
    parser.add_argument("--workers", type=lambda t: _counts(t, "--workers"), metavar="N[,N...]",
                        help="sizes of run to predict (default: 1,2,4,...,1024)")
    parser.add_argument("--max-servers", type=int, default=64, metavar="S",
                        help="most parameter-server shards to consider")
    parser.add_argument("--local-steps", type=lambda t: _counts(t, "--local-steps"), default=[1, 8],
                        metavar="H[,H...]", help="local steps between synchronisations to consider "
                                                 "(1: every step; default: 1,8)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    sim = parser.add_argument_group("simulation (the parameter server's own rules in virtual time)")
    sim.add_argument("--simulate", type=int, metavar="N",
                     help="simulate sync, backup workers, SSP and async at N workers, and the fastest "
                          "configuration with local updates of --local-steps (H > 1)")
    sim.add_argument("--sim-steps", type=int, default=200, metavar="STEPS",
                     help="steps per worker to simulate")
    sim.add_argument("--sim-share", action="store_true",
                     help="give each worker STEPS steps of data, after which it stops (an epoch without "
                          "--balance: the slowest worker ends the run, whatever the mode); default: work "
                          "without end, the steady state")
    sim.add_argument("--stragglers", type=float, default=0.0, metavar="FRACTION",
                     help="share of the workers whose steps are 3x slower")
    sim.add_argument("--tail", type=float, default=0.0, metavar="SIGMA",
                     help="log-normal sigma of each step's time (0: constant)")
    sim.add_argument("--failure-rate", type=float, default=0.0, metavar="P",
                     help="probability that a worker fails during a step")
    sim.add_argument("--backup-workers", type=int, metavar="B",
                     help="backup workers of the sync run (default: N/16, at least 1)")
    sim.add_argument("--staleness", type=int, default=2, metavar="TAU", help="SSP's bound")
    probe = parser.add_argument_group("link probe server")
    probe.add_argument("--serve", action="store_true",
                       help="serve link probes (for --peer on another machine) until Ctrl-C")
    probe.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT",
                       help="where --serve listens (port 0: any free port, printed)")
    add_token_flag(parser)
    add_insecure_flag(parser, "--serve: listen beyond this machine")


def run(args: argparse.Namespace) -> int:
    token = token_from_args(args)
    if args.serve:
        require_credentials(args.bind, "--bind", "the link probe server would be reachable from other "
                            "machines", token is not None, TlsFiles(), args.insecure)
        return _serve(args.bind, token)
    from disttrain.advise import advise, measure_workload
    from disttrain.advise.comparison import cost_model
    from disttrain.advise.report import advice_json, advice_lines, simulation_lines
    _check_numbers(args)
    config = config_from_args(args)
    link = _link(args, token)
    workload = measure_workload(config, repeats=1 if args.step_time else 3)
    if args.step_time is not None:
        workload = workload.with_step_time(args.step_time)
    model = cost_model(config, workload, link, args.step_time_cv)
    counts = args.workers or None
    advice = advise(model, *([counts] if counts else []), max_servers=args.max_servers,
                    sync_every=args.local_steps)
    simulations = _simulations(args, model) if args.simulate else []
    if args.json:
        print(json.dumps(advice_json(workload, link, advice, simulations), indent=2))
        return 0
    print("\n".join(advice_lines(workload, link, advice)))
    if simulations:
        print()
        print("\n".join(simulation_lines(simulations)))
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    """Raises ConfigError naming the first flag out of its range."""
    checks = [("--step-time", args.step_time, args.step_time is None or args.step_time > 0, "> 0"),
              ("--step-time-cv", args.step_time_cv, args.step_time_cv >= 0, ">= 0"),
              ("--max-servers", args.max_servers, args.max_servers >= 1, ">= 1"),
              ("--sim-steps", args.sim_steps, args.sim_steps >= 2, ">= 2"),
              ("--staleness", args.staleness, args.staleness >= 0, ">= 0")]
    for flag, value, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{flag} {value}: must be {rule}")


def _link(args: argparse.Namespace, token: str | None):
    from disttrain.advise import measure_link, measure_loopback, parse_link
    if args.link:
        return parse_link(args.link)
    if args.peer:
        parse_address(args.peer, "--peer")
        return measure_link(args.peer, token)
    return measure_loopback()


def _simulations(args: argparse.Namespace, model):
    from disttrain.advise import (
        Candidate,
        SimulationSetup,
        StepTimes,
        candidates,
        simulate,
        simulate_local_updates,
    )
    n = args.simulate
    if n < 1:
        raise ConfigError(f"--simulate {n}: give the number of workers to simulate, >= 1")
    backups = args.backup_workers if args.backup_workers is not None else max(1, n // 16)
    if n > 1 and not 0 <= backups < n:
        raise ConfigError(f"--backup-workers {backups}: must be in [0, {n})")
    workload = model.workload
    try:
        times = StepTimes(workload.compute_s, args.tail, args.stragglers, 3.0, args.failure_rate)
    except ValueError as e:
        raise ConfigError(f"simulation: {e}") from e
    best = max((model.predict(Candidate("ps-sync", "none", s), n) for s in _shards(n, args.max_servers)),
               key=lambda p: p.samples_per_s).candidate
    sync_trip = model.round_trip(best, n)
    async_trip = model.round_trip(Candidate("ps-async", "none", best.num_servers), n)
    steps, batch = args.sim_steps, workload.batch_size
    runs = [("sync", 0, sync_trip, steps)]
    if n > 1:
        runs.append(("sync", backups, sync_trip, steps))
    runs += [("ssp", 0, async_trip, steps * n), ("async", 0, async_trip, steps * n)]
    share = steps if args.sim_share else None
    results = [simulate(SimulationSetup(mode, n, updates, args.staleness, b, batch, steps_per_worker=share),
                        times, trip)
               for mode, b, trip, updates in runs]
    local_steps = [h for h in args.local_steps if h > 1]
    if local_steps:
        local = max((model.predict(c, n) for c in candidates(n, args.max_servers, local_steps, ("none",))
                     if c.sync_every > 1), key=lambda p: p.samples_per_s).candidate
        setup = SimulationSetup("local", n, steps, batch_size=batch, steps_per_worker=share,
                                sync_every=local.sync_every, fragments=local.fragments, delay=local.delay)
        inner = replace(times, mean_s=workload.compute_s + workload.optimizer_s)  # a worker's own optimizer
        results.append(simulate_local_updates(setup, inner, *model.fragment_exchange(local, n)))
    return results


def add_advise_link_flag(parser: argparse.ArgumentParser) -> None:
    """The link a comparison report's advice section predicts for (`compare`, `report`)."""
    parser.add_argument("--advise-link", metavar="BANDWIDTH,LATENCY",
                        help="the link the report's predicted scaling assumes, e.g. 10gbit,50us "
                             "(default: this machine's loopback, measured when the report is rendered)")


def advisor_from_args(args: argparse.Namespace) -> Advisor:
    """The advice section's predictor for `render_comparison`; call before any run starts,
    so a malformed --advise-link stops the command at once.

    Raises:
        ConfigError: --advise-link is malformed.
    """
    from disttrain.advise import parse_link
    from disttrain.advise.comparison import comparison_advisor
    try:
        link = parse_link(args.advise_link) if args.advise_link else None
    except ConfigError as e:
        raise ConfigError(str(e).replace("--link", "--advise-link", 1)) from e
    return comparison_advisor(link)


def _shards(n: int, max_servers: int) -> list[int]:
    return [s for s in (2**i for i in range(11)) if s <= min(n, max_servers)]


def _serve(bind: str, token: str | None) -> int:
    from disttrain.advise import ProbeServer
    host, port = parse_address(bind, "--bind")
    try:
        server = ProbeServer(host, port, token)
    except OSError as e:
        raise ConfigError(f"--bind {bind}: cannot listen there ({e.strerror or e})") from e
    server.start()
    print(f"serving link probes on {server.address}"
          + ("" if token else " (no token: anyone who reaches the port may probe)"), flush=True)
    try:
        server.wait()
    finally:
        server.stop()
    sys.stdout.flush()
    return 0
