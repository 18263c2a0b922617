"""`disttrain validate`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disttrain.cli.check import count, describe_training
from disttrain.cli.compare import add_runs_flags, runs_folder
from disttrain.cli.flags import add_config_flag, config_from_args
from disttrain.comparison.runner import LogDisplay
from disttrain.comparison.validate import RESULT_FILE, SPEEDUP_WORKERS, validate
from disttrain.config import Config
from disttrain.core.errors import ConfigError, DisttrainError
from disttrain.report.files import write_json_atomic

HELP = "train baseline, parameter server and DDP, and check their final checkpoints"
DESCRIPTION = f"""Final checkpoint validation. Trains the baseline, the parameter server (sync)
and DDP on the same budget (the same epochs and updates: the baseline trains on the
global batch, the batch size times --workers), loads each final model file back
(weights only, as `disttrain evaluate` does) and checks named properties, each written
true or false with its figures to <output-dir>/{RESULT_FILE} (and --output):

  <run>_finished                      the run ended with exit code 0 and a summary
  <run>_checkpoint_matches_summary    the final model file scores the summary's accuracy
                                      (a language model's: its loss too)
  ps_sync_no_samples_lost             the servers' ledgers hold every sample once
  accuracies_agree                    final accuracies within --tolerance of each other
  perplexities_agree                  a language model's, in place of accuracies_agree:
                                      final perplexities within --tolerance of the lowest
  <run>_speedup_over_baseline         more samples/s than the baseline; judged with
                                      --workers {SPEEDUP_WORKERS} on a machine with a core per worker
                                      (elsewhere written with applies: false and why)

Exit code 0 only when every property that applies holds.

    disttrain validate --workers 4 --epochs 2 --max-train-samples 5000 --max-test-samples 1000 \\
        --dataset mnist --data-dir DIR"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_runs_flags(parser, "runs/validate-<date>-<time>/")
    add_config_flag(parser, "--epochs", "training.num_epochs", int, "epochs to train (as --num-epochs)")
    parser.add_argument("--tolerance", type=float, default=0.03, metavar="FRACTION",
                        help="the most two strategies' final test accuracies may differ by "
                             "(default 0.03: 3 points); for a language model, their final "
                             "perplexities, as a fraction of the lowest")
    parser.add_argument("--output", metavar="PATH", help="also write the properties JSON here")


def prepare(args: argparse.Namespace) -> tuple[Config, Path]:
    """The config and the runs' folder, checked (a ConfigError otherwise)."""
    config = config_from_args(args)
    if not 0 <= args.tolerance <= 1:
        raise ConfigError(f"--tolerance: {args.tolerance} must be a fraction in [0, 1]")
    return config, runs_folder(args, "validate", "runs; choose another folder")


def check(args: argparse.Namespace) -> str:
    config, folder = prepare(args)
    return (f"baseline, ps-sync and ddp with {count(config.system.num_workers, 'worker')}, final "
            f"accuracies (a language model's perplexities) within {args.tolerance:g}; "
            f"{describe_training(config)}; into {folder}")


def run(args: argparse.Namespace) -> None:
    config, folder = prepare(args)
    from disttrain.report import render_comparison  # loads plotting only when a report is due

    result = validate(config, folder, args.tolerance, args.timeout_per_run, ["disttrain", *sys.argv[1:]],
                      LogDisplay(3))
    for path in [folder / RESULT_FILE, *([args.output] if args.output else [])]:
        write_json_atomic(path, result.to_dict())
    print(f"Report: {render_comparison(folder).html_path}")
    for prop in result.properties:
        verdict = "pass" if prop.holds else "FAIL"
        print(f"{verdict if prop.applies else 'n/a '}  {prop.name}"
              + (f"  ({prop.reason})" if prop.reason else ""))
    print(f"Properties: {folder / RESULT_FILE}")
    if not result.passed:
        failed = [p.name for p in result.properties if p.applies and not p.holds]
        raise DisttrainError(f"{len(failed)} properties do not hold: {', '.join(failed)}")
