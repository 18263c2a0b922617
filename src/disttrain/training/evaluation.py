"""Test accuracy (a language model's: perplexity) of a saved model file from any strategy.

Reads `{"model": state_dict, ...}` files (`baseline_final.pt`, `parameter_server_final.pt`,
`ddp_final.pt`) or a full training checkpoint, with `weights_only=True`.
"""

from __future__ import annotations

from pathlib import Path

from disttrain.config import TrainingConfig
from disttrain.core import checkpoint as ckpt
from disttrain.core.errors import CheckpointError
from disttrain.data import describe_dataset, load_datasets
from disttrain.training.engine import EvalResult, evaluate
from disttrain.training.models import build_for


def evaluate_model_file(path: str | Path, training: TrainingConfig) -> EvalResult:
    """Build the model named by `training`, load the weights at `path`, evaluate on the test set.

    Raises:
        CheckpointError: unreadable file, or weights that do not fit the model.
    """
    state = ckpt.load_checkpoint(path)
    ckpt.require_keys(state, ("model",), path)
    train_set, test_set = load_datasets(training)
    model = build_for(training.model_architecture, describe_dataset(training), training)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise CheckpointError(f"{path}: weights do not fit model {training.model_architecture!r} "
                              f"on {training.dataset} ({first})") from e
    return evaluate(model, test_set, training.eval_batch_size)
