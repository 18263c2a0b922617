"""A shard's optimizer step on the weighted sum of the pushed gradients (`combine`),
refused when it would leave a non-finite parameter.

Every pushed gradient is checked finite, but finite gradients can still overflow: a
huge value times the learning rate, a momentum buffer that grows past the dtype's
range. Such a step would poison the shard for every worker from then on, so it is
refused, with parameters and optimizer state left as they were.

Copying the parameters and the optimizer state before every step to undo it costs more
than the step itself once they outgrow the cache (1.1 ms of a 10 MB shard's push here,
and 0.6 ms more for the checks after it). So the update keeps an upper bound on every
magnitude instead: the decoder bounds each gradient in the pass that checks it finite
(`magnitude_bound`: the Euclidean norm, one pass), and the bounds after a step follow
from those before it (SGD: |p'| <= |p| + lr |step direction|; Adam, whose step is
bounded whatever the gradients: its moments' bounds follow from the gradient's). While
every bound stays far below the dtype's largest value, no step can overflow and none is
copied or checked. Otherwise (or for an optimizer whose bounds are not worked out) the
step is guarded: copied before, measured after, and undone when a value is not finite;
the measured magnitudes become the new bounds.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from disttrain.compression.schemes import magnitude_bound
from disttrain.strategies.ps.server.decisions import Contribution
from disttrain.strategies.ps.server.validation import InvalidPush

# A bound this far below the dtype's largest value leaves room for rounding in every sum.
HEADROOM = 16.0


class NonFiniteUpdate(InvalidPush):
    """A push whose update would leave a parameter non-finite: refused, nothing changed."""


class GuardedUpdate:
    """Applies weighted gradients to one flat parameter with its optimizer.

    Args:
        param: the shard's flat parameter.
        optimizer: the optimizer over `[param]`.
        extras: clipping and weight decay applied before each step (a `ShardOptimizer`:
            `prepare(gradient)`, `changes_gradient`, `bounds_group()`); None: none.
    """

    def __init__(self, param: nn.Parameter, optimizer: torch.optim.Optimizer, extras: Any = None):
        self.param = param
        self.optimizer = optimizer
        self.extras = extras
        self.limit = torch.finfo(param.dtype).max / HEADROOM
        # Reused by every update: a fresh buffer each time costs page faults on every page.
        self._gradient_sum = torch.empty_like(param.detach())
        self._buffers: dict[str, torch.Tensor] = {}
        self._saved: dict[str, Any] = {}
        self.bounds: dict[str, float] | None = None  # magnitude bounds by state name; None: unknown
        self.num_guarded = 0  # steps that were copied and checked

    def forget_bounds(self) -> None:
        """The parameters or the optimizer state changed outside `apply` (a restore)."""
        self.bounds = None

    def apply(self, contributions: list[Contribution]) -> bool:
        """One optimizer step on the weighted sum of `contributions`' gradients (each a
        `Gradient`, or chunks without a bound, which guard the step).

        Returns:
            True when applied; False when the step would have left a parameter (or a
            floating optimizer state) non-finite: then parameters and optimizer state
            are as they were before the call.
        """
        gradient = sum(abs(c.weight) * getattr(c.payload, "bound", math.inf) for c in contributions)
        predicted = self._predict(gradient)
        if predicted is not None and max(predicted.values()) <= self.limit:
            self._step(contributions)
            self.bounds = predicted
            return True
        self.num_guarded += 1
        self._save()
        self._step(contributions)
        measured = self._measure()
        if all(math.isfinite(v) for v in measured.values()):
            self.bounds = measured
            return True
        self._restore()
        return False

    def _step(self, contributions: list[Contribution]) -> None:
        gradient = combine(contributions, self._gradient_sum)
        if self.extras is not None:
            if self.extras.changes_gradient and gradient is not self._gradient_sum:
                # A lone push is used as it arrived; clipping or decay must not write into it.
                gradient = self._gradient_sum.copy_(gradient)
            self.extras.prepare(gradient)
        self.param.grad = gradient
        try:
            self.optimizer.step()
        finally:
            self.param.grad = None

    def _predict(self, gradient: float) -> dict[str, float] | None:
        """Bounds after a step on a gradient bounded by `gradient`; None when they cannot
        be told (unknown bounds, an unbounded gradient, an optimizer not worked out)."""
        if self.bounds is None or not math.isfinite(gradient):
            return None
        (group,) = self.optimizer.param_groups
        if self.extras is not None:
            group = self.extras.bounds_group()
        if isinstance(self.optimizer, torch.optim.SGD):
            return _sgd_bounds(group, self.bounds, gradient)
        if isinstance(self.optimizer, torch.optim.Adam):
            return _adam_bounds(group, self.bounds, gradient)
        return None

    def _measure(self) -> dict[str, float]:
        """A bound on the magnitudes of the parameters and of each floating optimizer
        state (NaN or infinity when one holds such a value)."""
        measured = {"param": magnitude_bound(self.param.detach())}
        for key, value in self.optimizer.state.get(self.param, {}).items():
            if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                measured[key] = magnitude_bound(value)
        return measured

    def _save(self) -> None:
        self._saved = {"param": self.param.detach()}
        self._saved.update(self.optimizer.state.get(self.param, {}))
        for key, value in self._saved.items():
            if torch.is_tensor(value):
                buffer = self._buffers.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = self._buffers[key] = torch.empty_like(value)
                buffer.copy_(value)
            else:
                self._saved[key] = copy.deepcopy(value)

    def _restore(self) -> None:
        saved = dict(self._saved)
        with torch.no_grad():
            saved.pop("param").copy_(self._buffers["param"])
        state = self.optimizer.state[self.param]
        state.clear()
        for key, value in saved.items():
            if torch.is_tensor(value):
                value.copy_(self._buffers[key])  # the same tensor object: fused kernels keep pointers
            state[key] = value
        if not state:
            del self.optimizer.state[self.param]


def _sgd_bounds(group: dict[str, Any], bounds: dict[str, float], gradient: float) -> dict[str, float]:
    """|p'| <= |p| + lr |d| with d = g + wd p, or with momentum buf' = momentum buf +
    (1 - dampening) d (buf' = d on the first step) and d = buf' (nesterov: d + momentum buf')."""
    lr, momentum, param = abs(float(group["lr"])), abs(float(group["momentum"])), bounds["param"]
    direction = gradient + abs(group["weight_decay"]) * param
    predicted = {}
    if momentum:
        damped = max(1.0, abs(1.0 - float(group["dampening"]))) * direction
        buffer = predicted["momentum_buffer"] = momentum * bounds.get("momentum_buffer", 0.0) + damped
        direction = direction + momentum * buffer if group["nesterov"] else buffer
    predicted["param"] = param + lr * direction
    return predicted


def _adam_bounds(group: dict[str, Any], bounds: dict[str, float], gradient: float) -> dict[str, float] | None:
    """Adam's moments follow their averages: |m'| <= b1 |m| + (1 - b1) |g|, v' <= b2 v +
    (1 - b2) g^2. Its step is bounded whatever the gradients: each coordinate's
    |m| / sqrt(v) <= (1 - b1) / sqrt(1 - b2) / (1 - b1 / sqrt(b2)) (every gradient in m is
    also in v, with weights that fall slower when b1 < sqrt(b2)), and bias correction
    multiplies that by at most 1 / (1 - b1), so |p'| <= |p| + lr / (sqrt(1 - b2) (1 - b1 /
    sqrt(b2)))."""
    beta1, beta2 = (float(b) for b in group["betas"])
    if group["amsgrad"] or not 0 <= beta1 < math.sqrt(beta2) < 1:
        return None
    lr, decay, param = abs(float(group["lr"])), abs(float(group["weight_decay"])), bounds["param"]
    if group.get("decoupled_weight_decay"):
        param *= max(1.0, abs(1.0 - lr * decay))
    else:
        gradient += decay * param
    step = 1.0 / (math.sqrt(1.0 - beta2) * (1.0 - beta1 / math.sqrt(beta2)))
    return {"param": param + lr * step,
            "exp_avg": beta1 * bounds.get("exp_avg", 0.0) + (1.0 - beta1) * gradient,
            "exp_avg_sq": beta2 * bounds.get("exp_avg_sq", 0.0) + (1.0 - beta2) * gradient * gradient}


def combine(contributions: list[Contribution], out: torch.Tensor) -> torch.Tensor:
    """The weighted sum of gradients (each a list of 1-D chunks), in rank order, so the
    result does not depend on the order they arrived in.

    A single unweighted gradient in one chunk is used as it is; otherwise `out` receives
    the running weighted mean: one `lerp` pass per gradient after the first two (a pass
    reads two streams and writes one, where multiply-then-add needs one pass more).
    """
    first = contributions[0]
    if len(contributions) == 1 and first.weight == 1.0 and len(first.payload) == 1:
        return first.payload[0]
    weights = [c.weight for c in contributions]
    for start, end, pieces in _aligned([c.payload for c in contributions]):
        target = out[start:end]
        if len(pieces) == 1:
            torch.mul(pieces[0], weights[0], out=target)
            continue
        seen = weights[0] + weights[1]
        torch.lerp(pieces[0], pieces[1], weights[1] / seen, out=target)
        for weight, piece in zip(weights[2:], pieces[2:], strict=True):
            seen += weight
            target.lerp_(piece, weight / seen)
        if abs(seen - 1.0) > 1e-9:  # the rules normalise the weights; this is for callers that don't
            target.mul_(seen)
    return out


def _aligned(payloads: list[list[torch.Tensor]]):
    """Walk several chunked 1-D tensors of one length together: yield (start, end, views)
    for each range inside one chunk of every payload (chunk boundaries may differ, e.g.
    one gradient in one piece from shared memory, another in 1 MB pieces from the wire)."""
    bounds = sorted({0} | {end for chunks in payloads for end in _chunk_ends(chunks)})
    cursors = [[0, 0] for _ in payloads]  # (chunk index, chunk start) per payload
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        views = []
        for chunks, cursor in zip(payloads, cursors, strict=True):
            while start >= cursor[1] + chunks[cursor[0]].numel():
                cursor[1] += chunks[cursor[0]].numel()
                cursor[0] += 1
            offset = start - cursor[1]
            views.append(chunks[cursor[0]][offset:offset + end - start])
        yield start, end, views


def _chunk_ends(chunks: list[torch.Tensor]) -> list[int]:
    ends, total = [], 0
    for chunk in chunks:
        total += chunk.numel()
        ends.append(total)
    return ends
