"""One real step before training: the model and the data are tried together once, in the
process that launches the run, before any other process starts.

A model that cannot take the data set's batches (a wrong input shape, fewer outputs than
classes, floats into an embedding, a forward that returns no logits) otherwise fails at
step 1 in every training process, as a torch traceback that never names the data. Here
the model is built as every process builds it (`init_model`), the first batch of the
training set is drawn, and forward, the loss and backward run on it, off the run's random
streams (the run's model and batches are the same with or without the check). A failure
is one line (`ConfigError`, exit code 2) naming what the model returned or raised against
what the data set gives, and the user's file and line where the error is in their code.
`--check-config` runs it too (`dry_run_step`), but for a data set it cannot read there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from disttrain.config import TrainingConfig
from disttrain.core.errors import ConfigError, DataError
from disttrain.data import LANGUAGE_MODEL, DatasetDescription, describe_dataset, load_datasets
from disttrain.data.plugins import one_line, user_frame
from disttrain.training.engine import Inputs, ModelOutputError, logits_of, objective_of
from disttrain.training.models import init_model

KEY = "training.model_architecture"


def check_first_step(training: TrainingConfig, every_gradient: bool = False) -> str:
    """Run one step of `training`'s model on the first batch of its training set.

    Args:
        every_gradient: the exchange needs a gradient of every trainable parameter at
            every step (DDP without `ddp.find_unused_parameters`).
    Returns:
        What the step saw, for `--check-config`: "one step on a batch of 64: logits
        (64, 10), loss 2.31".
    Raises:
        ConfigError: the model, its data or the two together fail (one line).
        DataError: the data set cannot be loaded.
    """
    description = describe_dataset(training)
    with torch.random.fork_rng(devices=[]):
        model = init_model(training)
        train_set, _ = load_datasets(training)
        size = min(training.batch_size, len(train_set))
        try:
            inputs, targets = train_set.batch(torch.arange(size))
        except (ConfigError, DataError):
            raise
        except Exception as e:  # the user's items, or their collation
            raise ConfigError(f"training.dataset: the first batch of {training.dataset} cannot be drawn: "
                              f"{one_line(e)}{user_frame(e)}") from e
        given = describe_batch(inputs, targets, description)
        objective = objective_of(model)
        model.train()
        try:
            output = objective.forward(model, inputs, targets)
        except Exception as e:
            raise ConfigError(f"{KEY}: {training.model_architecture}'s forward failed on {given}: "
                              f"{one_line(e)}{user_frame(e)}") from e
        try:
            logits = logits_of(output)
        except ModelOutputError as e:
            raise ConfigError(f"{KEY}: {training.model_architecture}, given {given}: {e}") from e
        if objective.name == "task":  # the task's loss takes logits of the targets' shape
            check_logits(logits, targets, description, training.model_architecture, given)
        try:
            loss = objective.loss(output, logits, targets)
        except ModelOutputError as e:
            raise ConfigError(f"{e}, given {given}") from e
        except Exception as e:
            raise ConfigError(f"training.loss: the loss ({training.loss}) of {training.model_architecture} "
                              f"failed on {given}: {one_line(e)}{user_frame(e)}") from e
        try:
            loss.backward()
        except Exception as e:
            raise ConfigError(f"{KEY}: the backward of {training.model_architecture} failed on {given}: "
                              f"{one_line(e)}{user_frame(e)}") from e
        if every_gradient:
            check_every_gradient(model, training.model_architecture, given)
    return f"one step on a batch of {size}: logits {tuple(logits.shape)}, loss {float(loss.detach()):.3g}"


class UnusedParameters(ConfigError):
    """A step left trainable parameters without a gradient where DDP's module needs one each."""


def check_every_gradient(model: torch.nn.Module, name: str, given: str) -> None:
    """Every trainable parameter took a gradient in the step just run: DDP's all-reduce
    waits for each one, and fails the next step on one that took none."""
    missing = [key for key, param in model.named_parameters() if param.requires_grad and param.grad is None]
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UnusedParameters(f"{KEY}: {len(missing)} trainable parameter(s) of {name} took no gradient "
                               f"in a step on {given} ({listed}); DDP needs ddp.find_unused_parameters: "
                               "true (--find-unused-parameters) for a model that leaves some unused, or "
                               "freeze them")


def dry_run_step(training: TrainingConfig, every_gradient: bool = False) -> str:
    """`check_first_step` for `--check-config`, which writes nothing and may run where
    the data set is not (a launching machine, a container built without it): nothing is
    downloaded, and where the data cannot be read no step is tried and the phrase says
    so; the run itself stops on the missing data as before.

    Raises:
        ConfigError: as `check_first_step`.
    """
    try:
        return check_first_step(replace(training, download=False), every_gradient)
    except DataError:
        return f"no step tried: {training.dataset} cannot be read on this machine"


def describe_batch(inputs: Inputs, targets: torch.Tensor, description: DatasetDescription) -> str:
    """E.g. "a batch of inputs (64, 1, 8, 8) float32 with 10 classes"; for a batch of
    fields, "a batch of fields input_ids (8, 12) int64, attention_mask (8, 12) int64 with
    targets (8,) int64"."""
    if isinstance(inputs, Mapping):
        fields = ", ".join(f"{key} {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
                           for key, value in inputs.items())
        return f"a batch of fields {fields} with targets {tuple(targets.shape)} " + \
            str(targets.dtype).removeprefix("torch.")
    dtype = str(inputs.dtype).removeprefix("torch.")
    if description.task == LANGUAGE_MODEL:
        return (f"a batch of token ids {tuple(inputs.shape)} {dtype} below a vocabulary of "
                f"{description.vocab_size}")
    return f"a batch of inputs {tuple(inputs.shape)} {dtype} with {description.num_classes} classes"


def check_logits(logits: torch.Tensor, targets: torch.Tensor, description: DatasetDescription, name: str,
                 given: str) -> None:
    """Logits of the shape the loss takes: (B, C) for classes (B,), or (B, T, V) for next
    tokens (B, T), with at least as many columns as classes (a vocabulary)."""
    want = tuple(targets.shape)
    if description.task == LANGUAGE_MODEL:
        expected, what = f"{want + (description.vocab_size,)}", f"a vocabulary of {description.vocab_size}"
    else:
        expected, what = f"{want + (description.num_classes,)}", f"{description.num_classes} classes"
    if logits.dim() != len(want) + 1 or tuple(logits.shape[:-1]) != want:
        raise ConfigError(f"{KEY}: {name} returned logits {tuple(logits.shape)} for {given}; the loss needs "
                          f"{expected} (one row of scores per target)")
    if logits.shape[-1] < description.num_classes:
        raise ConfigError(f"{KEY}: {name} returned {logits.shape[-1]} scores per target for {what}; give "
                          f"its last layer {description.num_classes} outputs")
    if not logits.is_floating_point():
        raise ConfigError(f"{KEY}: {name} returned logits of {logits.dtype} for {given}; return float "
                          "scores")
