"""The exactness reference of synchronous parameter-server runs: one process stepping
with the run's optimizer, schedule, weight decay and clipping (plain SGD at learning rate
0.1 in most tests) on the batches a run's workers stepped on together, and the run's
final model held against it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from disttrain.config import Config, load_config
from disttrain.core.checkpoint import load_checkpoint
from disttrain.data import ArrayDataset, load_datasets
from disttrain.training.engine import build_optimizer
from disttrain.training.models import init_model
from disttrain.training.stepping import OptimizerStep


def assert_matches_one_process(tmp_path: Path,
                               batches: Callable[[Config, ArrayDataset], Iterable[torch.Tensor]]) -> Config:
    """The final model in `<tmp_path>/ckpt` equals one process's stepping on `batches(config,
    train_set)` in order, to 1e-5; returns the run's config (from `<tmp_path>/logs`)."""
    config = load_config(tmp_path / "logs" / "config.yaml")
    train_set, _ = load_datasets(config.training)
    model = init_model(config.training)
    stepper = OptimizerStep(build_optimizer(model.parameters(), config.training), config.training)
    norms = []
    for batch in batches(config, train_set):
        inputs, targets = train_set.batch(batch)
        stepper.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        stepper.step()
        norms.append(stepper.last_grad_norm)
    if config.training.clip_grad_norm:  # the run is a test of clipping only if some step clipped
        assert max(norms) > config.training.clip_grad_norm, norms
    final = load_checkpoint(tmp_path / "ckpt" / "parameter_server_final.pt")["model"]
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(final[name], expected, rtol=0, atol=1e-5, msg=name)
    return config
