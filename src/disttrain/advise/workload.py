"""What one worker's step costs on this machine: the model's gradient size and its forward,
backward and optimizer times at the configured batch, and each compressor's payload and
encode/decode time on the model's own gradients: the payload schemes (for pushes, with
top-k's compact block as well, and at `compression.pull_ratio` for pull compression) and
PowerSGD at `compression.powersgd_rank` (its arithmetic on each gradient matrix, timed as
PyTorch's hook does it: P = MQ, orthogonalise P, Q = MᵀP to encode; PQᵀ to decode);
and what an overlapped push's CPU work adds to backward (`contention`).

The model and its input shapes come from the project's builders (`init_model`,
`describe_dataset`), so a user's model file is measured as it would be trained. The batch
is random data of the data set's shapes: a step's time does not depend on the values, and
nothing is downloaded or loaded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from disttrain.advise.contention import contention_s, measure_contention
from disttrain.compression import SCHEMES, Compressor
from disttrain.compression.dgc import DgcRules
from disttrain.config import Config
from disttrain.core.errors import ConfigError
from disttrain.data import LANGUAGE_MODEL, DatasetDescription, describe_dataset
from disttrain.training import build_optimizer, init_model
from disttrain.training.engine import configure_process, logits_of, objective_of

# Measured repeats of each timing after one warm-up; the median is kept.
NUM_REPEATS = 3


@dataclass(frozen=True)
class CompressionCost:
    """One compressor on the whole model's gradient: its payload and its compute; `ratio`
    is topk's share of elements (PowerSGD: its rank)."""

    scheme: str
    ratio: float
    payload_bytes: int
    encode_s: float
    decode_s: float


@dataclass(frozen=True)
class Workload:
    """One worker's step, as the cost model needs it.

    `forward_s + backward_s` is the compute of one step at `batch_size`; `compute_std_s`
    its spread over the measured repeats (0 when given); `optimizer_s` one optimizer step
    over every parameter (what the shards together spend applying an update); `shapes`
    the trainable parameters' shapes, in order (what PowerSGD and the shards' slices
    follow); `pull_compression` the payload schemes on a pulled change (no error
    feedback, at the pull ratio); `overlap_contention_s` what one overlapped push's CPU
    work adds to backward on this machine's cores (`contention`).
    """

    model: str
    num_parameters: int
    gradient_bytes: int
    num_tensors: int
    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    compute_std_s: float = 0.0
    source: str = "measured"
    compression: dict[str, CompressionCost] = field(default_factory=dict)
    shapes: tuple[tuple[int, ...], ...] = ()
    pull_compression: dict[str, CompressionCost] = field(default_factory=dict)
    overlap_contention_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def with_step_time(self, step_time_s: float) -> Workload:
        """The same model on another device whose forward+backward takes `step_time_s`:
        split between forward and backward as measured here, the optimizer's step scaled
        by the same factor (the compressors' times and the overlap's contention, CPU work,
        are kept as measured); no spread."""
        share = self.backward_s / self.compute_s if self.compute_s > 0 else 2 / 3
        scale = step_time_s / self.compute_s if self.compute_s > 0 else 1.0
        return replace(self, forward_s=step_time_s * (1 - share), backward_s=step_time_s * share,
                       optimizer_s=self.optimizer_s * scale, compute_std_s=0.0, source="given")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compute_s": self.compute_s}


def random_batch(description: DatasetDescription, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random inputs and targets of the data set's shapes."""
    generator = torch.Generator().manual_seed(0)
    if description.task == LANGUAGE_MODEL:
        shape = (batch_size, description.seq_len)
        tokens = torch.randint(description.vocab_size, shape, generator=generator)
        return tokens, torch.randint(description.vocab_size, shape, generator=generator)
    inputs = torch.randn((batch_size, *description.input_shape), generator=generator)
    return inputs, torch.randint(description.num_classes, (batch_size,), generator=generator)


def _median_time(action: Callable[[], Any], repeats: int) -> list[float]:
    action()  # warm-up: allocator, kernels' first calls
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return times


def measure_workload(config: Config, repeats: int = NUM_REPEATS,
                     compression_ratio: float | None = None) -> Workload:
    """Build the configured model and time its step and the compressors on this machine.

    Args:
        compression_ratio: topk's share of elements (default: `compression.ratio`).
    Raises:
        ConfigError: the model or data-set plug-in cannot be found, fails to build, or
            fails a step on a batch of the data set's shapes.
        DataError: an unknown data set.
    """
    training = config.training
    configure_process(config.system.num_threads)
    description = describe_dataset(training)
    model = init_model(training)
    inputs, targets = random_batch(description, training.batch_size)
    try:
        forward, backward = _time_step(model, inputs, targets, repeats)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"training.model_architecture: {training.model_architecture} failed a step on a "
                          f"batch of {tuple(inputs.shape)} from {training.dataset}: {first}") from e
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, training)
    optimizer_s = statistics.median(_median_time(optimizer.step, repeats))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for _, p in named]).float()
    segments = [(name, p.numel()) for name, p in named]
    ratio = config.compression.ratio if compression_ratio is None else compression_ratio
    # top-k with the run's DGC rules (momentum correction, clipping: their work is in the
    # encode), as they run once the sparsity warm-up is over
    rules = DgcRules.of(config.compression) if config.compression.type == "topk" else None
    rules = replace(rules, warmup_steps=0) if rules is not None else None
    costs = {scheme: measure_compressor(Compressor(scheme, ratio, rules=rules if scheme == "topk" else None),
                                        flat, segments, repeats) for scheme in SCHEMES}
    costs["topk-compact"] = measure_compressor(Compressor("topk", ratio, rules=rules, compact=True), flat,
                                               segments, repeats)
    gradients = [p.grad for _, p in named]
    costs["powersgd"] = measure_powersgd(gradients, config.compression.powersgd_rank, repeats)
    pull_ratio = config.compression.pull_ratio
    pull = {scheme: cost if scheme != "topk" or pull_ratio == ratio
            else measure_compressor(Compressor(scheme, pull_ratio), flat, segments, repeats)
            for scheme, cost in costs.items() if scheme in SCHEMES}
    totals = [f + b for f, b in zip(forward, backward, strict=True)]
    alone, pushing = measure_contention(model, inputs, targets, config.ps.num_servers)
    return Workload(training.model_architecture, sum(p.numel() for p in params),
                    sum(p.numel() * p.element_size() for p in params), len(params), training.batch_size,
                    statistics.median(forward), statistics.median(backward), optimizer_s,
                    statistics.pstdev(totals), "measured", costs, tuple(tuple(p.shape) for p in params),
                    pull, contention_s(alone, pushing))


def _time_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
               repeats: int) -> tuple[list[float], list[float]]:
    """Forward (with the loss) and backward times of `repeats` steps, after one warm-up."""
    model.train()
    objective = objective_of(model)
    forward, backward = [], []
    for attempt in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        output = objective.forward(model, inputs, targets)
        loss = objective.loss(output, logits_of(output), targets)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        if attempt:
            forward.append(middle - start)
            backward.append(end - middle)
    return forward, backward


def measure_compressor(compressor: Compressor, flat: torch.Tensor, segments: list[tuple[str, int]],
                       repeats: int = NUM_REPEATS) -> CompressionCost:
    """Payload bytes and median encode and decode seconds of `compressor` on gradient `flat`
    (as the run builds it: top-k's compact block is named topk-compact; its DGC rules, if
    any, are applied in the encode timed)."""
    encoded = compressor.encode(flat, segments)
    out = torch.empty_like(flat)
    encode_s = statistics.median(_median_time(lambda: compressor.encode(flat, segments), repeats))
    decode_s = statistics.median(_median_time(lambda: compressor.decode(encoded.data, segments, out),
                                              repeats))
    name = "topk-compact" if compressor.compact else compressor.scheme
    return CompressionCost(name, compressor.ratio, encoded.nbytes, encode_s, decode_s)


def measure_powersgd(gradients: list[torch.Tensor], rank: int, repeats: int = NUM_REPEATS) -> CompressionCost:
    """PowerSGD at `rank` on `gradients`: the payload by the hook's rule (`payloads`), the
    median encode and decode seconds of its arithmetic on every matrix it compresses."""
    from disttrain.advise.payloads import powersgd_plan

    plans = powersgd_plan(tuple(tuple(g.shape) for g in gradients), rank)
    itemsize = gradients[0].element_size() if gradients else 4
    payload = sum(t.sent_numel for t in plans) * itemsize
    generator = torch.Generator().manual_seed(0)
    matrices = [(g.reshape(t.rows, t.cols).float(), torch.randn(t.cols, t.rank, generator=generator))
                for g, t in zip(gradients, plans, strict=True) if t.rank]
    factors: list[tuple[torch.Tensor, torch.Tensor]] = []

    def encode() -> None:
        factors.clear()
        for m, q in matrices:
            p = torch.linalg.qr(m @ q).Q  # the hook orthogonalises P (QR, or Gram-Schmidt)
            factors.append((p, m.t() @ p))

    encode_s = statistics.median(_median_time(encode, repeats))
    decode_s = statistics.median(_median_time(lambda: [p @ q.t() for p, q in factors], repeats))
    return CompressionCost("powersgd", float(rank), payload, encode_s, decode_s)
