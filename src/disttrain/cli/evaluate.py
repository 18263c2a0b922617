"""`disttrain evaluate`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from disttrain.cli.flags import add_common_flags, config_from_args

if TYPE_CHECKING:
    from disttrain.training.engine import EvalResult

HELP = "test accuracy of a saved model file"
DESCRIPTION = """Print the test accuracy and loss of a saved model: a *_final.pt file of any
strategy, or a training checkpoint. Give the data set (and model) it was trained with.

    disttrain evaluate --dataset mnist --data-dir DIR checkpoints/baseline_final.pt"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # What the model and the test split depend on; nothing about training or its outputs.
    add_common_flags(parser, only=("--dataset", "--data-dir", "--model", "--max-test-samples",
                                   "--num-samples", "--seq-len"))
    parser.add_argument("model_file", help="a *_final.pt model file or a training checkpoint")


def run(args: argparse.Namespace) -> EvalResult:
    from disttrain.data import LANGUAGE_MODEL, describe_dataset
    from disttrain.training.evaluation import evaluate_model_file
    training = config_from_args(args).training
    result = evaluate_model_file(args.model_file, training)
    if describe_dataset(training).task == LANGUAGE_MODEL:
        print(f"Test Perplexity: {result.perplexity:.3f}")
    else:
        print(f"Test Accuracy: {result.accuracy * 100:.2f}%")
    print(f"Test Loss: {result.loss:.4f}")
    print(f"Samples: {result.num_samples}")
    return result
