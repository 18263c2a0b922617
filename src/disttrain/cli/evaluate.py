"""`disttrain evaluate`."""

from __future__ import annotations

import argparse

from disttrain.cli.flags import add_common_flags, config_from_args
from disttrain.training.engine import EvalResult
from disttrain.training.evaluation import evaluate_model_file

HELP = "test accuracy of a saved model file"
DESCRIPTION = """Print the test accuracy and loss of a saved model: a *_final.pt file of any
strategy, or a training checkpoint. Give the data set (and model) it was trained with.

    disttrain evaluate --dataset mnist --data-dir DIR checkpoints/baseline_final.pt"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_flags(parser)
    parser.add_argument("model_file", help="a *_final.pt model file or a training checkpoint")


def run(args: argparse.Namespace) -> EvalResult:
    result = evaluate_model_file(args.model_file, config_from_args(args).training)
    print(f"Test Accuracy: {result.accuracy * 100:.2f}%")
    print(f"Test Loss: {result.loss:.4f}")
    print(f"Samples: {result.num_samples}")
    return result
