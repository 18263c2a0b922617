"""`disttrain baseline`."""

from __future__ import annotations

import argparse

from disttrain.cli.check import describe_folders, describe_training
from disttrain.cli.flags import add_training_flags, prepare_run
from disttrain.config import Config
from disttrain.metrics.summary import RunSummary
from disttrain.training.options import RunOptions

HELP = "train in one process (the control group)"
DESCRIPTION = """Train the model in this one process: the control group every other strategy is
compared with. Writes metrics, TensorBoard events, checkpoints, the final model
(baseline_final.pt) and summary.json.

    disttrain baseline --dataset mnist --data-dir DIR --num-epochs 2
    disttrain baseline --config example --resume
    disttrain baseline --config configs/example_config.yaml --check-config"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser)


def prepare(args: argparse.Namespace) -> tuple[Config, RunOptions]:
    """The run's config and options, checked (a ConfigError otherwise); warns about keys
    the run ignores."""
    return prepare_run(args, "baseline")


def check(args: argparse.Namespace) -> str:
    from disttrain.strategies.baseline import baseline_precision
    from disttrain.training.first_step import dry_run_step
    config, options = prepare(args)
    step = dry_run_step(config.training)  # as the run does: a model that cannot take the data fails
    baseline_precision(config.training.precision)
    return f"train {describe_training(config)} in one process ({step}); {describe_folders(config, options)}"


def run(args: argparse.Namespace) -> RunSummary:
    from disttrain.strategies.baseline import STRATEGY
    return STRATEGY.run(*prepare(args))
