"""`disttrain compare`."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from disttrain.cli.advise import add_advise_link_flag, advisor_from_args
from disttrain.cli.check import add_check_flag, count, describe_training
from disttrain.cli.config_warnings import warn_about_comparison_config
from disttrain.cli.flags import COMMON_FLAGS, CONFIG_HELP, add_config_flags, config_from_args
from disttrain.comparison.plan import DEFAULT_STRATEGIES, KNOWN, PlannedRun, equal_threads, parse_strategies
from disttrain.comparison.runner import MANIFEST, Comparison, LogDisplay
from disttrain.config import Config
from disttrain.core.errors import ConfigError, DisttrainError

HELP = "train every strategy on one config and report them side by side"
DESCRIPTION = f"""Train the same model on the same data, seed and budget with each strategy in
turn, then write one report comparing them: report.html (one page, plots inline),
report.md, report.json and PNG plots, in --output-dir (default runs/compare-<time>/).
Prints the table at the end: accuracy, time to 90/95/97/98% test accuracy (a language
model: perplexity, time to test perplexity 32/16/8/4), samples/s, speed-up over the
baseline, scaling efficiency, bytes on the wire per step, compression, recovery events.
Every process of every run computes with the same torch threads (--num-threads; by
default this machine's cores divided by --workers). Each run keeps
its own logs, checkpoints and summary in <output-dir>/<strategy>/; a run that fails is
reported as failed and the others still run (the exit code is then 1).

Strategies: {KNOWN}.

    disttrain compare --dataset mnist --data-dir DIR --workers 2 --num-epochs 1
    disttrain compare --config configs/example_config.yaml \\
        --strategies baseline,ps-sync,ps-ssp,ps-async,ddp,ps-sync+topk,ddp+powersgd
    disttrain report runs/compare-<time>/        # render a finished comparison again"""

OWN_FOLDERS = ("--log-dir", "--checkpoint-dir")  # each run gets its own under --output-dir


def add_runs_flags(parser: argparse.ArgumentParser, default_folder: str) -> None:
    """The flags of a command that trains several runs on one config: the config and its
    training flags (each run gets its own folders), --workers, --output-dir,
    --timeout-per-run, --set and -v."""
    parser.add_argument("--config", help=f"{CONFIG_HELP}; every run trains it")
    add_config_flags(parser, {flag: spec for flag, spec in COMMON_FLAGS.items() if flag not in OWN_FOLDERS})
    add_config_flags(parser, {"--workers": ("system.num_workers", int,
                                            "workers (parameter server) and ranks (DDP) of each "
                                            "parallel run; the baseline has one process")})
    parser.add_argument("--output-dir", metavar="DIR", help=f"where the runs go (default: {default_folder}; "
                        "must not hold runs already)")
    parser.add_argument("--timeout-per-run", type=float, default=3600.0, metavar="SECONDS",
                        help="stop a run still going after this long and count it as failed "
                             "(default: 3600)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key of every run (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_check_flag(parser)


def runs_folder(args: argparse.Namespace, default_name: str, holds: str) -> Path:
    """--output-dir, or runs/<default_name>-<date>-<time>; refused when it holds runs already.

    Raises:
        ConfigError: the folder holds a manifest; `holds` says what the user finds there
            and what to do (`{folder}` in it names the folder).
    """
    folder = Path(args.output_dir or f"runs/{default_name}-{datetime.now():%Y%m%d-%H%M%S}")
    if (folder / MANIFEST).exists():
        raise ConfigError(f"--output-dir: {folder} already holds {holds.format(folder=folder)}")
    return folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_runs_flags(parser, "runs/compare-<date>-<time>/, with the report")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, metavar="LIST",
                        help=f"comma-separated runs, in order (default: {DEFAULT_STRATEGIES})")
    add_advise_link_flag(parser)


def prepare(args: argparse.Namespace) -> tuple[Config, list[PlannedRun], Path]:
    """The config every run trains, the runs and their folder, checked (a ConfigError
    otherwise); warns about keys that no run acts on."""
    config = config_from_args(args)
    runs = parse_strategies(args.strategies, config.system.num_workers)
    warn_about_comparison_config((run.config(config), run.subcommand) for run in runs)
    config = equal_threads(config, runs)
    if args.timeout_per_run <= 0:
        raise ConfigError(f"--timeout-per-run: {args.timeout_per_run} must be > 0")
    folder = runs_folder(args, "compare", "a comparison; choose another folder, or render it "
                         "again with `disttrain report {folder}`")
    return config, runs, folder


def first_step(config: Config, runs: list[PlannedRun]) -> str:
    """One step of the model on the data (`dry_run_step`), as each run's launcher takes it,
    and, where a DDP run wraps the model in DDP's module, with every trainable parameter's
    gradient required, as `disttrain ddp` requires it: a model that leaves one unused is
    refused before any run starts, rather than failing its DDP runs at their second step.

    Raises:
        ConfigError: the step fails, or leaves a parameter DDP waits for without a gradient.
    """
    from disttrain.strategies.ddp import runtime as rt
    from disttrain.training.first_step import UnusedParameters, dry_run_step
    ddp = [run for run in runs if run.subcommand == "ddp" and rt.needs_every_gradient(run.config(config))]
    try:
        return dry_run_step(config.training, every_gradient=bool(ddp))
    except UnusedParameters as e:
        raise ConfigError(f"--strategies {ddp[0].name}: {e}; in compare, pass "
                          "--set ddp.find_unused_parameters=true") from e


def check(args: argparse.Namespace) -> str:
    config, runs, folder = prepare(args)
    step = first_step(config, runs)
    return (f"{count(len(runs), 'run')} in turn ({', '.join(run.name for run in runs)}), "
            f"{count(config.system.num_workers, 'worker')} each, "
            f"{count(config.system.num_threads, 'torch thread')} per process; "
            f"{describe_training(config)} ({step}); into {folder}")


def run(args: argparse.Namespace) -> None:
    config, runs, folder = prepare(args)
    first_step(config, runs)
    advisor = advisor_from_args(args)
    comparison = Comparison(folder, config, runs, ["disttrain", *sys.argv[1:]], args.timeout_per_run)
    from disttrain.report import render_comparison  # loads plotting only when a report is due

    records = comparison.run(LogDisplay(len(runs)))
    report = render_comparison(folder, advisor)
    print(report.table)
    print(f"Report: {report.html_path}")
    failed = [r.name for r in records if r.status != "ok"]
    if failed:
        raise DisttrainError(f"{len(failed)} of {len(records)} runs failed ({', '.join(failed)}); "
                             f"their errors are in the table, their logs in {folder}/<strategy>/output.log")
