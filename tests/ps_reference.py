"""The exactness reference of synchronous parameter-server runs: one process stepping
with the run's optimizer, schedule, weight decay and clipping (plain SGD at learning rate
0.1 in most tests) on the batches a run's workers stepped on together, and the run's
final model held against it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from disttrain.config import Config, load_config
from disttrain.core.checkpoint import load_checkpoint
from disttrain.data import ArrayDataset, ShardedSampler, load_datasets
from disttrain.training.engine import build_optimizer, forward_backward, task_loss
from disttrain.training.models import init_model
from disttrain.training.stepping import OptimizerStep


def assert_matches_one_process(tmp_path: Path,
                               batches: Callable[[Config, ArrayDataset], Iterable[torch.Tensor]],
                               final: str = "parameter_server_final.pt") -> Config:
    """The final model `final` in `<tmp_path>/ckpt` equals one process's stepping on `batches(config,
    train_set)` in order, with the task's loss (a language model's: over every token), to
    1e-5; with clipping on, some step must have clipped. Returns the run's config (from
    `<tmp_path>/logs`)."""
    config = load_config(tmp_path / "logs" / "config.yaml")
    train_set, _ = load_datasets(config.training)
    model = init_model(config.training)
    stepper = OptimizerStep(build_optimizer(model.parameters(), config.training), config.training)
    norms = []
    for batch in batches(config, train_set):
        inputs, targets = train_set.batch(batch)
        stepper.optimizer.zero_grad()
        forward_backward(model, inputs, targets)
        stepper.step()
        norms.append(stepper.last_grad_norm)
    if config.training.clip_grad_norm:  # the run is a test of clipping only if some step clipped
        assert max(norms) > config.training.clip_grad_norm, norms
    trained = load_checkpoint(tmp_path / "ckpt" / final)["model"]
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(trained[name], expected, rtol=0, atol=1e-5, msg=name)
    return config


def concatenated(config: Config, train_set: ArrayDataset) -> Iterator[torch.Tensor]:
    """Both workers' (or ranks') batches of each step, concatenated: what one process steps
    on to match a 2-worker synchronous run."""
    samplers = [ShardedSampler(len(train_set), world_size=2, rank=r, seed=config.training.seed)
                for r in range(2)]
    for batches in zip(*(s.batches(config.training.batch_size) for s in samplers), strict=True):
        yield torch.cat(batches)


def per_worker_reference(config: Config, train_set: ArrayDataset, steps: Iterable[list[torch.Tensor]],
                         buffer_rule: str) -> dict[str, torch.Tensor]:
    """One process stepping with plain SGD (learning rate 0.1) on each step's batches of
    all workers together (`steps`: per step, each worker's batch indices, in rank order),
    with BatchNorm's batch statistics taken over each worker's batch, as the workers take
    them: the loss is the mean over the concatenated batch, so its gradient is the
    sample-weighted mean of the workers' gradients. The buffers after each step follow
    `buffer_rule`: "average" (the parameter server's: the sample-weighted mean of the
    buffers each worker's forward pass leaves, from the same start) or "rank0" (DDP's
    broadcast from rank 0: those rank 0's pass leaves). Returns the final state_dict."""
    model = init_model(config.training)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers = dict(model.named_buffers())
    for parts in steps:
        total = sum(len(part) for part in parts)
        start = {name: b.clone() for name, b in buffers.items()}
        after = []
        optimizer.zero_grad()
        model.train()
        for part in parts:
            with torch.no_grad():
                for name, b in buffers.items():
                    b.copy_(start[name])
            inputs, targets = train_set.batch(part)
            loss = task_loss(model(inputs), targets)
            (loss * (len(part) / total)).backward()
            after.append({name: b.clone() for name, b in buffers.items()})
        optimizer.step()
        with torch.no_grad():
            for name, b in buffers.items():
                if buffer_rule == "rank0":
                    b.copy_(after[0][name])
                else:
                    mean = sum(a[name].double() * (len(p) / total) for a, p in zip(after, parts, strict=True))
                    b.copy_(mean.round() if not b.is_floating_point() else mean)
    return model.state_dict()
