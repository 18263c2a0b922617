"""`disttrain baseline`."""

from __future__ import annotations

import argparse

from disttrain.cli.flags import (
    add_training_flags,
    config_from_args,
    not_used_yet_epilog,
    options_from_args,
)
from disttrain.metrics.summary import RunSummary
from disttrain.strategies.baseline import STRATEGY

HELP = "train in one process (the control group)"
DESCRIPTION = """Train the model in this one process: the control group every other strategy is
compared with. Writes metrics, TensorBoard events, checkpoints, the final model
(baseline_final.pt) and summary.json.

    disttrain baseline --dataset mnist --data-dir DIR --num-epochs 2
    disttrain baseline --config configs/example_config.yaml --resume"""
EPILOG = not_used_yet_epilog()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser)


def run(args: argparse.Namespace) -> RunSummary:
    return STRATEGY.run(config_from_args(args), options_from_args(args))
