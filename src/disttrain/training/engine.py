"""The training step and evaluation every strategy shares, and their small helpers.

Call order in a step: `forward_backward` (gradients land in `.grad`), then whatever the
strategy does with gradients (nothing, all-reduce, push to servers), then the optimizer.
`train_step` is that sequence for a single process.

The loss is the task's: for classification, logits (B, C) against class indices (B,); for
a language model, logits (B, T, V) against next-token ids (B, T), the mean cross-entropy
over every token. Both are one `cross_entropy` over the flattened predictions, so the
step, its gradient and every strategy's aggregation are the same code for both.

A model's forward may return its logits as a tensor, as the first item of a tuple or list,
or as the `logits` of a mapping or of an output object (Hugging Face models' `ModelOutput`
is both): `logits_of` takes them out, the same way in training and evaluation. Its inputs
are a tensor, or a mapping of named tensors that forward takes as keyword arguments (a
batch of `datasets` rows: `model(**inputs)`). What a step minimises is the model's
`Objective` (`training.loss`): the task's cross-entropy, the loss the model computes
itself given `labels=`, or a function of the user's; every strategy's step and evaluation
ask the model's objective (`objective_of`), set once where the model is built. Targets
of `IGNORE_INDEX` (padding) count in neither the loss nor the accuracy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.config import TrainingConfig
from disttrain.core.allocator import tune_allocator
from disttrain.core.processes import thread_count
from disttrain.data import LANGUAGE_MODEL, BatchedDataset, plugins
from disttrain.data.batching import IGNORE_INDEX
from disttrain.metrics.time_to_target import perplexity_of
from disttrain.training.precision import Precision
from disttrain.training.schedule import remember_initial_rates


def configure_process(num_threads: int, processes_per_machine: int = 1) -> int:
    """Set up a training process at its start: torch's intra-op threads, so N processes
    don't fight over cores (`thread_count`), and the C allocator (`tune_allocator`: large
    freed blocks kept in the heap). Returns the thread count set."""
    num_threads = thread_count(num_threads, processes_per_machine)
    torch.set_num_threads(num_threads)
    tune_allocator()
    return num_threads


def parameter_groups(params, weight_decay: float) -> list[dict[str, Any]]:
    """`params` in two optimizer groups: weights of two or more dimensions decay by
    `weight_decay`, one-dimensional parameters (biases, normalisation weights) do not, as
    users of AdamW expect. Empty groups are left out; order within a group is kept."""
    params = [p for p in params if p.requires_grad]
    decayed = [p for p in params if p.dim() >= 2]
    kept = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decayed, "weight_decay": weight_decay},
                        {"params": kept, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(params, training: TrainingConfig, learning_rate: float | None = None,
                    fused: bool | None = None) -> torch.optim.Optimizer:
    """SGD (with `momentum`), Adam or AdamW, per `training.optimizer`, over the parameter
    groups of `parameter_groups` (no weight decay on one-dimensional parameters: a
    parameter server's flat shard is one-dimensional, and decays by its own mask).

    Each group records its rate as `initial_lr`, the rate `schedule.LRSchedule` scales.

    Args:
        fused: use torch's fused kernels (several times faster on one large tensor).
    Raises:
        ValueError: an unknown `training.optimizer`.
    """
    lr = training.learning_rate if learning_rate is None else learning_rate
    groups = parameter_groups(params, training.weight_decay)
    if training.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=training.momentum, fused=fused)
    elif training.optimizer == "adam":
        optimizer = torch.optim.Adam(groups, lr=lr, fused=fused)
    elif training.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=lr, fused=fused)
    else:
        raise ValueError(f"training.optimizer: unknown optimizer {training.optimizer!r}; use sgd, adam "
                         "or adamw")
    return remember_initial_rates(optimizer)


def clip_gradients(params, max_norm: float) -> float:
    """Scale the gradients of `params` together so their global L2 norm is at most
    `max_norm` (torch's `clip_grad_norm_`). Call on the gradient that will be applied:
    after the all-reduce, after unscaling fp16, before `optimizer.step()`.

    Returns:
        The global norm before clipping.
    """
    return float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm))


def task_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of `logits` (..., C) against `targets` (...): over samples for
    classification, over every token for a language model's (B, T, V) logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           reduction=reduction)


class ModelOutputError(TypeError):
    """A model's forward returned something that holds no logits (`logits_of`)."""


def logits_of(output: Any) -> torch.Tensor:
    """The logits in what a model's forward returned: the tensor itself, the first item of
    a tuple or list, or the `logits` of a mapping or an output object.

    Raises:
        ModelOutputError: none of these is a tensor; the message says what came back.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, Mapping):
        what = f"a mapping with keys {sorted(map(str, output))[:8]}"
    elif isinstance(output, (tuple, list)):
        first = type(output[0]).__name__ if output else "nothing"
        what = f"a {type(output).__name__} of {len(output)} item(s), the first a {first}"
    else:
        what = f"a {type(output).__name__}"
    raise ModelOutputError(f"the model's forward returned {what}, which holds no logits; return a tensor, a "
                           "tuple whose first item is one, or a mapping or output object with `logits`")


def count_correct(logits: torch.Tensor, targets: torch.Tensor) -> int:
    """Predictions (samples, or tokens of a language model) whose top logit is the target,
    padding (`IGNORE_INDEX`) left out; 0 where the logits do not score the targets' classes
    (a user's loss of another kind of output)."""
    if tuple(logits.shape[:-1]) != tuple(targets.shape) or targets.is_floating_point():
        return 0
    return int(((logits.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum())


def num_predictions(targets: torch.Tensor) -> int:
    """What a batch's loss and accuracy count: its targets but padding (`IGNORE_INDEX`)."""
    return targets.numel() if targets.is_floating_point() else int((targets != IGNORE_INDEX).sum())


Inputs = torch.Tensor | Mapping[str, torch.Tensor]


def to_device(inputs: Inputs, device: torch.device | str, non_blocking: bool = False) -> Inputs:
    """`inputs` (a tensor, or a mapping of tensors) on `device`."""
    if isinstance(inputs, Mapping):
        return {key: value.to(device, non_blocking=non_blocking) for key, value in inputs.items()}
    return inputs.to(device, non_blocking=non_blocking)


OBJECTIVES = ("task", "model")


@dataclass(frozen=True)
class Objective:
    """What a step minimises (`training.loss`).

    - `task`: the cross-entropy of the logits against the targets (`task_loss`).
    - `model`: the model's own: the targets go to forward as `labels=...` (as Hugging Face
      models take them) and its output's `loss` is used as it is.
    - a user's function (PATH.py:FN, module:FN), called as `fn(output, targets)`.
    """

    name: str = "task"
    function: Callable[[Any, torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, spec: str) -> Objective:
        """The objective `training.loss` names.

        Raises:
            ConfigError: a function that cannot be found.
        """
        if spec in OBJECTIVES:
            return cls(spec)
        return cls(spec, plugins.load_factory(spec, "training.loss", plugins.LOSS_GROUP))

    def forward(self, model: nn.Module, inputs: Inputs, targets: torch.Tensor) -> Any:
        """What the model returns for `inputs` (keyword arguments when a mapping)."""
        labels = {"labels": targets} if self.name == "model" else {}
        if isinstance(inputs, Mapping):
            return model(**inputs, **labels)
        return model(inputs, **labels)

    def loss(self, output: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (a scalar)."""
        if self.name == "task":
            return task_loss(logits, targets)
        if self.function is None:
            loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
            if not isinstance(loss, torch.Tensor):
                raise ModelOutputError("training.loss=model: the model's forward, given labels=..., returned "
                                       "no `loss`; return one, or use training.loss=task")
        else:
            loss = self.function(output, targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = f"a tensor {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
                    f"a {type(loss).__name__}"
                raise ModelOutputError(f"training.loss: {self.name} returned {what}, not a scalar tensor")
        return loss.float().reshape(())


_OBJECTIVES: weakref.WeakKeyDictionary[nn.Module, Objective] = weakref.WeakKeyDictionary()


def set_objective(model: nn.Module, objective: Objective) -> nn.Module:
    """Give `model` its objective (where it is built); returns it."""
    _OBJECTIVES[model] = objective
    return model


def objective_of(model: nn.Module) -> Objective:
    """`model`'s objective, or that of the model it wraps (DDP's `.module`); the task's
    for a model given none."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, nn.Module) and candidate in _OBJECTIVES:
            return _OBJECTIVES[candidate]
    return Objective()


@dataclass
class StepResult:
    """One step as the training loop counts it: the mean loss over its samples (a language
    model's: over their tokens), how many predictions it got right (samples, or tokens),
    the samples, and the step's own figures (metric keys, e.g. `time/comm_blocked_s`)."""

    loss: float
    num_correct: int
    num_samples: int
    scalars: dict[str, float] = field(default_factory=dict)


def forward_backward(model: nn.Module, inputs: Inputs, targets: torch.Tensor,
                     loss_scale: float = 1.0, precision: Precision | None = None) -> StepResult:
    """Forward, loss (the model's objective: by default the mean cross-entropy), backward:
    gradients accumulate into `.grad`.

    Args:
        loss_scale: multiplies the loss before backward (1/k for k accumulated micro-batches).
        precision: mixed precision: the forward pass under its autocast, the loss in float32
            outside it, fp16's loss scaled before backward (None: full precision).
    """
    model.train()
    objective = objective_of(model)
    with precision.autocast() if precision is not None else nullcontext():
        output = objective.forward(model, inputs, targets)
        logits = logits_of(output)
    loss = objective.loss(output, logits, targets)  # in float32, outside autocast
    weighted = loss * loss_scale if loss_scale != 1.0 else loss
    (precision.scale(weighted) if precision is not None else weighted).backward()
    with torch.no_grad():
        correct = count_correct(logits, targets)
    return StepResult(float(loss.detach()), correct, len(targets))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Inputs,
               targets: torch.Tensor) -> StepResult:
    """One single-process step: zero grads, forward/backward, optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    result = forward_backward(model, inputs, targets)
    optimizer.step()
    return result


@dataclass
class EvalResult:
    """Sums, so ranks can add theirs before dividing. `num_predictions` counts what the loss
    and `num_correct` are summed over: the samples (0 says so), or a language model's tokens."""

    loss_sum: float
    num_correct: int
    num_samples: int
    num_predictions: int = 0

    @property
    def predictions(self) -> int:
        return max(self.num_predictions or self.num_samples, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.predictions

    @property
    def accuracy(self) -> float:
        """The share of predictions right (a language model's: next tokens)."""
        return self.num_correct / self.predictions

    @property
    def perplexity(self) -> float:
        """exp(mean cross-entropy): what a language model reports instead of accuracy."""
        return perplexity_of(self.loss)

    def sums(self) -> list[float]:
        """The figures ranks add up (`from_sums` makes the total)."""
        return [self.loss_sum, self.num_correct, self.num_samples, self.num_predictions]

    @classmethod
    def from_sums(cls, sums) -> EvalResult:
        loss_sum, correct, samples, predictions = sums
        return cls(float(loss_sum), int(correct), int(samples), int(predictions))

    def figures(self, task: str) -> dict[str, float]:
        """The test figures of the metrics vocabulary: loss and accuracy, or for a language
        model loss and perplexity."""
        if task == LANGUAGE_MODEL:
            return {"loss/test": self.loss, "perplexity/test": self.perplexity}
        return {"loss/test": self.loss, "accuracy/test": self.accuracy}


def eval_slice(num_samples: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the test indices, when `world_size` processes
    evaluate together; the slices cover each index once."""
    return torch.tensor_split(torch.arange(num_samples), world_size)[rank]


@torch.no_grad()
def evaluate(model: nn.Module, dataset: BatchedDataset, batch_size: int = 1000,
             indices: torch.Tensor | None = None, device: torch.device | str = "cpu") -> EvalResult:
    """Loss and accuracy of `model` on `dataset` (or on `indices` of it), in eval mode."""
    was_training = model.training
    model.eval()
    objective = objective_of(model)
    order = torch.arange(len(dataset)) if indices is None else indices
    loss_sum, correct, predictions = 0.0, 0, 0
    for start in range(0, len(order), batch_size):
        inputs, targets = dataset.batch(order[start:start + batch_size])
        inputs, targets = to_device(inputs, device), targets.to(device)
        output = objective.forward(model, inputs, targets)
        logits = logits_of(output)
        counted = num_predictions(targets)
        if objective.name == "task":
            loss_sum += float(task_loss(logits, targets, reduction="sum"))
        else:  # a mean over what the batch counts
            loss_sum += float(objective.loss(output, logits, targets)) * counted
        correct += count_correct(logits, targets)
        predictions += counted
    model.train(was_training)
    return EvalResult(loss_sum, correct, len(order), predictions)
