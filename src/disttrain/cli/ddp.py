"""`disttrain ddp` (the launcher) and `python -m disttrain.torchrun` (one rank, as torchrun or
the launcher starts it).

`python -m disttrain.torchrun` decides by its environment: started by an elastic agent (the
rank variables are set) it is one rank; typed by hand it is the same as `disttrain ddp`.
Environment variables are read here and nowhere deeper.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import replace

from disttrain import cli
from disttrain.cli.check import (
    count,
    describe_compression,
    describe_coordinator,
    describe_folders,
    describe_security,
    describe_training,
    wants_check,
)
from disttrain.cli.flags import (
    COMPRESSION_FLAGS,
    LOCAL_UPDATE_FLAGS,
    add_config_flag,
    add_insecure_flag,
    add_tls_flags,
    add_token_flag,
    add_training_flags,
    balance_flags,
    check_exposure,
    config_from_args,
    options_from_args,
    prepare_run,
    size_arg,
    split_size_range,
)
from disttrain.config import Config
from disttrain.core.errors import ConfigError, DisttrainError, Preempted, error_lines
from disttrain.core.logs import setup_logging
from disttrain.core.process_spec import FLAGS
from disttrain.metrics.summary import RunSummary
from disttrain.training.options import RunOptions

logger = logging.getLogger(__name__)

HELP = "data-parallel ranks with ring all-reduce (torch.distributed)"
DESCRIPTION = """Train with DistributedDataParallel: start this node's ranks through torch's
elastic agent (the engine behind torchrun), each on its shard of the data, gradients
averaged by ring all-reduce (gloo on CPU, NCCL on GPU). Checks the world size, backend
and checkpoint folder before starting anything; --max-restarts restarts the group after
a failure, from the newest checkpoint. Rank 0 writes ddp_final.pt and summary.json.

A coordinator watches the ranks: each registers as rank<R> and heartbeats its progress.
On one node, disttrain ddp starts its own, with its registry at <log-dir>/cluster.db
(--resume keeps it); several nodes share one started with `disttrain coordinator`
(--coordinator HOST:PORT on every node). `disttrain status` shows every rank's state,
heartbeat age, restarts, step and throughput, during the run or after it.

    disttrain ddp --world-size 2 --dataset mnist --num-epochs 1
    disttrain status --registry logs/cluster.db
    disttrain ddp --world-size 2 --compression-enabled --compression-type powersgd --powersgd-rank 2
    disttrain ddp --world-size 4 --sync-every 32 --outer-optimizer nesterov --outer-lr 0.7 \
        --outer-momentum 0.9
    disttrain ddp --world-size 8 --nnodes 2 --rdzv-endpoint node0:29400 --config ddp.yaml \
        --coordinator node0:50050
    disttrain ddp --ddp-recovery live --world-size 2:3 --rdzv-endpoint node0:29400 --config ddp.yaml
    disttrain ddp --ddp-recovery live --world-size 2:3 --rdzv-endpoint node0:29400 --config ddp.yaml --join
    torchrun --standalone --nproc-per-node 2 -m disttrain.torchrun --config ddp.yaml"""



# flag -> (config key, type, help): the DDP knobs on top of the common training flags.
DDP_FLAGS = {
    "--world-size": ("system.num_workers", size_arg, "ranks in all, over every node; MIN:MAX (live "
                     "recovery): an elastic run that starts MIN ranks, takes ranks started with --join up to "
                     "MAX (ddp.max_world_size) and trains while at least MIN remain"),
    "--backend": ("ddp.backend", str, "auto (NCCL when every rank has a GPU, else gloo), gloo or nccl"),
    "--max-restarts": ("ddp.max_restarts", int, "restarts of the rank group in a row without "
                       "progress (a new checkpoint; live: a step past the rank's furthest), each from "
                       "the newest checkpoint; one after progress is free; 0: no restarts"),
    "--bucket-cap-mb": ("ddp.bucket_cap_mb", float, "gradient bucket size for all-reduce"),
    "--gradient-as-bucket-view": ("ddp.gradient_as_bucket_view", bool,
                                  "gradients are views into the buckets (saves a copy)"),
    "--static-graph": ("ddp.static_graph", bool, "the graph is the same every step"),
    "--find-unused-parameters": ("ddp.find_unused_parameters", bool,
                                 "a step may leave a trainable parameter without a gradient"),
    "--grad-accumulation-steps": ("ddp.grad_accumulation_steps", int,
                                  "micro-batches per optimizer step (one all-reduce per step)"),
    "--lr-scaling": ("ddp.lr_scaling", str, "none, or linear (learning rate x world size)"),
    "--timeout-s": ("ddp.timeout_s", float, "rendezvous and collective timeout"),
    "--ddp-recovery": ("ddp.recovery", str, "what a rank's death does: restart (torch's elastic agent "
                       "restarts every rank from the newest checkpoint) or live (the survivors re-form "
                       "their group and train on, nothing lost; the rank, started again, rejoins them "
                       "at a step boundary; gloo)"),
    "--nnodes": ("ddp.num_nodes", int, "nodes taking part (each runs this command)"),
    "--rdzv-endpoint": ("ddp.rdzv_endpoint", str, "HOST:PORT of the rendezvous for several nodes"),
    "--rdzv-id": ("ddp.rdzv_id", str, "run id every node of one run shares"),
    "--join": ("ddp.join", bool, "add one rank to the running elastic run whose live store is at "
               "--rdzv-endpoint (give the run's --world-size MIN:MAX and settings)"),
    "--spares": ("ddp.spares", int, "hot spares (live recovery): ranks started beside the group that "
                 "start up and wait; one steps in at a step boundary when a member dies or leaves"),
    **balance_flags("rank"),
    **COMPRESSION_FLAGS,
    **LOCAL_UPDATE_FLAGS,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, DDP_FLAGS)
    add_config_flag(parser, "--coordinator", "coordinator.address", str,
                    "a running `disttrain coordinator` the ranks report to, instead of one started "
                    "for this run (how a run of several nodes is watched)", metavar="HOST:PORT")
    parser.add_argument(FLAGS.quiet_summary, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(FLAGS.rank, type=int, default=None, help=argparse.SUPPRESS)  # a live rank's slot
    add_token_flag(parser)
    add_tls_flags(parser)
    add_insecure_flag(parser, "report to a coordinator on another machine")


def prepare(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> tuple[Config, RunOptions]:
    """The run's config and options, checked (a ConfigError otherwise); warns about keys
    the run ignores; refuses to report to a coordinator on another machine without the
    run's token or client certificates (unless --insecure); `--world-size MIN:MAX` is
    split into its keys first (`split_size_range`)."""
    split_size_range(args, "--world-size", "ddp.max_world_size")
    config, options = prepare_run(args, "ddp", env)
    if config.coordinator.address:
        check_exposure(args, config.coordinator.address, "--coordinator",
                       "the ranks would call a coordinator on another machine, open to anyone there",
                       options)
    return config, options


def check(args: argparse.Namespace) -> str:
    """The launcher's checks that need neither data nor checkpoints, on this machine's GPUs."""
    import torch

    from disttrain.strategies.ddp import runtime as rt
    from disttrain.training.first_step import dry_run_step
    from disttrain.training.precision import plan_precision
    config, options = prepare(args)
    ddp, world_size = config.ddp, config.system.num_workers
    rt.check_supported(config)
    if ddp.recovery == "live":
        from disttrain.strategies.ddp.live.launcher import live_problems
        problems = live_problems(config)
        if problems:
            raise ConfigError("; ".join(problems))
    if world_size % ddp.num_nodes:
        raise ConfigError(f"system.num_workers: world size {world_size} does not split evenly "
                          f"over ddp.num_nodes={ddp.num_nodes}; use a multiple of {ddp.num_nodes}")
    backend = rt.node_backend(ddp.backend, world_size // ddp.num_nodes,
                              torch.cuda.device_count() if torch.cuda.is_available() else 0)
    precision = config.training.precision
    plan_precision(precision, rt.select_device(backend, 0).type,
                   precision == "bf16" and backend == "nccl" and torch.cuda.is_bf16_supported())
    step = dry_run_step(config.training, rt.needs_every_gradient(config))
    nodes = (f"{count(ddp.num_nodes, 'node')}, rendezvous at {ddp.rdzv_endpoint}" if ddp.rdzv_endpoint
             else "this node only")
    if ddp.backend == "auto" and backend == "nccl" and ddp.num_nodes > 1:
        backend = "nccl if every node has GPUs, else gloo"
    return (f"{count(world_size // ddp.num_nodes, 'rank')} on this node of {world_size} ({nodes}; "
            f"{backend}), up to {count(ddp.max_restarts, 'restart')}{describe_recovery(config)}, "
            f"{describe_coordinator(config, 'with its own coordinator')}{describe_security(options)}; "
            f"{describe_training(config)}{describe_compression(config)}{describe_local_updates(config)} "
            f"({step}); {describe_folders(config, options)}")


def describe_recovery(config: Config) -> str:
    """" (live recovery: ...)" when ranks recover live; empty for torch's restart."""
    ddp = config.ddp
    if ddp.recovery != "live":
        return ""
    if ddp.join:
        return f" (live recovery: one rank joins the elastic run at {ddp.rdzv_endpoint})"
    spares = f", {count(ddp.spares, 'hot spare')} waiting to step in" if ddp.spares else ""
    if ddp.max_world_size:
        return (f" (live recovery, elastic: {config.system.num_workers} to {ddp.max_world_size} ranks, "
                f"--join adds one, a SIGTERMed rank leaves{spares})")
    return f" (live recovery: the survivors train on, a restarted rank rejoins{spares})"


def describe_local_updates(config: Config) -> str:
    """", local updates (sync every 8 steps, outer nesterov)"-style suffix; empty when off."""
    training = config.training
    if not training.local_update_mode:
        return ""
    return f", local updates (sync every {training.sync_every} steps, outer {training.outer_optimizer})"


def run(args: argparse.Namespace) -> RunSummary | None:
    """`disttrain ddp`: start this node's ranks through the elastic agent and wait."""
    from disttrain.strategies.ddp import STRATEGY
    return STRATEGY.run(*prepare(args))


def rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m disttrain.torchrun", description=DESCRIPTION,
                                     formatter_class=cli.HelpFormatter)
    add_arguments(parser)
    return parser


def rank_main(argv: list[str], env: Mapping[str, str]) -> int:
    """Run one rank. Returns the exit code: 0, 2 for bad input, 1 for a failure.

    A failure's one-line message goes to stderr and to the agent's error file, where
    the launcher (or torchrun) reads it.
    """
    from disttrain.strategies.ddp.error_file import AtomicErrorHandler
    from disttrain.strategies.ddp.rank import run_rank
    from disttrain.strategies.ddp.runtime import RankInfo
    args = rank_parser().parse_args(argv)
    if wants_check(args):  # a dry run under torchrun: the same check as `disttrain ddp`
        return cli.main(["ddp", *argv])
    info = RankInfo.from_env(env)
    setup_logging("rank", info.rank, level=logging.DEBUG if args.verbose else logging.INFO)
    if info.is_main and restarts_need_fresh_store(env):
        logger.warning("torchrun shares its rendezvous store with the ranks, so a restarted group "
                       "reads the dead group's addresses and cannot connect (pytorch/pytorch#135712); "
                       "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun --max-restarts")
    try:
        options = own_identity(options_from_args(args, env), info.rank, env)
        summary = run_rank(config_from_args(args), info, options)
        if summary is not None and args.summary_json:
            summary.write(args.summary_json)
    except DisttrainError as e:
        for line in error_lines(e):
            print(f"error: rank {info.rank}: {line}", file=sys.stderr)
        AtomicErrorHandler().record_exception(e)
        return e.exit_code
    except BaseException as e:
        AtomicErrorHandler().record_exception(e)
        raise
    if summary is not None and not args.quiet_summary:
        print("\n".join(summary.lines()), flush=True)
    return 0


def own_identity(options: RunOptions, rank: int, env: Mapping[str, str]) -> RunOptions:
    """`options` with the token rank `rank` calls in its own name with (node `rank<R>`, role
    rank: the coordinator then lets it act as itself only): read from the folder of rank
    tokens its launcher named (`disttrain ddp`, which keeps the run's secret out of the
    ranks' environment), else made from the secret when the rank was handed one (a user's
    own torchrun, whose agent hands every rank its environment). Only that token is left in
    the environment of the processes the rank starts (its loader workers).

    Raises:
        ConfigError: the rank's token file cannot be read.
    """
    from disttrain.core.auth import TOKEN_ENV
    from disttrain.core.identity import own_token
    from disttrain.strategies.ddp.heartbeats import node_id
    from disttrain.strategies.ddp.rank_tokens import RANK_TOKENS_ENV, read_rank_token
    folder = env.get(RANK_TOKENS_ENV)
    os.environ.pop(RANK_TOKENS_ENV, None)
    if folder:
        token: str | None = read_rank_token(folder, rank)
    else:
        token = None if options.token is None else own_token(options.token, node_id(rank), "rank")
    if token is None:
        return options
    os.environ[TOKEN_ENV] = token
    return replace(options, token=token)


def live_rank_main(argv: list[str], env: Mapping[str, str]) -> int:
    """Run one rank of a live-recovery run (started by `disttrain ddp --ddp-recovery live`,
    which passes its slot as --rank, its restart as --attempt, and its store in the
    environment). Returns the exit code: 0, 2 for bad input, 1 for a failure."""
    from disttrain.core.processes import bind_to_parent, report_error
    from disttrain.strategies.ddp.heartbeats import LIVE_RESTART, LoopProgress, coordinator_link
    from disttrain.strategies.ddp.live import LIVE_STORE_ENV, run_live_rank, store_address
    from disttrain.training.checkpoints import Position
    from disttrain.training.engine import configure_process
    bind_to_parent()
    args = rank_parser().parse_args(argv)
    setup_logging("rank", args.rank, level=logging.DEBUG if args.verbose else logging.INFO)
    try:
        config, options = config_from_args(args), options_from_args(args, env)
        configure_process(config.system.num_threads, processes_per_machine=config.system.num_workers)
        progress = LoopProgress(Position(), config.training.num_epochs)
        with coordinator_link(config.coordinator, args.rank, args.attempt, progress, options.credentials,
                              LIVE_RESTART):
            summary = run_live_rank(config, args.rank, args.attempt, store_address(env[LIVE_STORE_ENV]),
                                    options, progress)
        if summary is not None and args.summary_json:
            summary.write(args.summary_json)
    except Preempted as e:  # SIGTERMed: a planned leave, not an error (the launcher does not restart it)
        print(f"rank {args.rank}: {e}", file=sys.stderr)
        return e.exit_code
    except DisttrainError as e:
        report_error(e)  # the launcher's supervisor: a user's error is not restarted
        for line in error_lines(e):
            print(f"error: rank {args.rank}: {line}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        report_error(e)
        raise
    return 0


def restarts_need_fresh_store(env: Mapping[str, str]) -> bool:
    """Restarts are allowed but the agent shares its store (torchrun's default)."""
    return (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and env.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0"))


def module_main(argv: list[str], env: Mapping[str, str]) -> int:
    """`python -m disttrain.torchrun`: a rank under an elastic agent, else the launcher.

    A rank leaves with `os._exit` once its work is flushed: gloo's worker threads (kept
    alive by the DDP reducer's hold on the process group) may still drop a finished
    collective's tensors, which needs the interpreter, and during interpreter shutdown
    that aborts the process (SIGABRT, "terminate called without an active exception"),
    about one run in ten on a busy machine (see pytorch/pytorch#179291, a fix proposed
    upstream and not merged).
    """
    from disttrain.strategies.ddp.live import LIVE_STORE_ENV
    from disttrain.strategies.ddp.runtime import started_by_elastic_agent
    if LIVE_STORE_ENV in env:
        code = live_rank_main(argv, env)
    elif not started_by_elastic_agent(env):
        return cli.main(["ddp", *argv])
    else:
        code = rank_main(argv, env)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
