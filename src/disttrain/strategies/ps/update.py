"""A shard's optimizer step, undone when it would leave a non-finite parameter.

Every pushed gradient is checked finite, but finite gradients can still overflow: a
huge value times the learning rate, a momentum buffer that grows past the dtype's
range. Such a step would poison the shard for every worker from then on, so it is
refused: before each step the parameters and the optimizer state are copied into
buffers kept from step to step (no allocation, no page faults: one memory copy each),
and restored when the step leaves a non-finite value.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from disttrain.compression.schemes import all_finite
from disttrain.strategies.ps.combine import combine
from disttrain.strategies.ps.decisions import Contribution
from disttrain.strategies.ps.validation import InvalidPush


class NonFiniteUpdate(InvalidPush):
    """A push whose update would leave a parameter non-finite: refused, nothing changed."""


def _finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point():
        return True
    # One reduction usually settles it: a finite sum means every element is finite.
    return bool(torch.isfinite(tensor.sum())) or all_finite(tensor)


class GuardedUpdate:
    """Applies weighted gradients to one flat parameter with its optimizer.

    Args:
        param: the shard's flat parameter.
        optimizer: the optimizer over `[param]`.
    """

    def __init__(self, param: nn.Parameter, optimizer: torch.optim.Optimizer):
        self.param = param
        self.optimizer = optimizer
        # Reused by every update: a fresh buffer each time costs page faults on every page.
        self._gradient_sum = torch.empty_like(param.detach())
        self._buffers: dict[str, torch.Tensor] = {}
        self._saved: dict[str, Any] = {}

    def apply(self, contributions: list[Contribution]) -> bool:
        """One optimizer step on the weighted sum of `contributions`' gradients.

        Returns:
            True when applied; False when the step would have left a parameter (or a
            floating optimizer state) non-finite: then parameters and optimizer state
            are as they were before the call.
        """
        self._save()
        self.param.grad = combine(contributions, self._gradient_sum)
        try:
            self.optimizer.step()
        finally:
            self.param.grad = None
        state = self.optimizer.state.get(self.param, {})
        if _finite(self.param.detach()) and all(_finite(v) for v in state.values() if torch.is_tensor(v)):
            return True
        self._restore()
        return False

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
