"""Pushes that start during the backward pass: each shard's gradient goes out as soon as
backward has produced all of it, as BytePS and DDP's reducer overlap communication with
the gradients still being computed.

The bucket is the shard's slice. A shard owns one contiguous range of the flat vector,
which holds the parameters in the model's order (`wire.sharding`), and backward produces
gradients in about the reverse order, so the last shard's gradient is complete first and
its push (and, in the same round trip, the pull of the parameters it leads to) travels
while backward still computes the earlier layers. Buckets finer than a shard would need
a shard to accumulate several partial pushes of one step before its aggregation rules
see one; keeping a push whole keeps the wire, the ledger, duplicates and retries as
they are.

`ShardTrigger` watches each trainable parameter's post-accumulate-grad hook and counts,
per shard, the parameters whose gradient is still to come; the call that completes a
shard launches it. Hooks fire on every backward, but act only while the exchange has
armed the trigger for the gradient of a step (not on a recomputation after a refused
push, nor on a redo, which push the classic way). A parameter that took no gradient in
this backward (unused by the forward pass) never fires its hook: `disarm` returns the
shards still waiting, to be launched once backward is over.

The pushes' intervals give the communication time in flight while the backward pass
still computed (`overlapped_s`); what the step waited for after it is its blocked time,
the same split DDP's buckets report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import nn

from disttrain.strategies.ps.wire.sharding import ShardPlan, trainable_parameters

logger = logging.getLogger(__name__)


def shards_of_parameters(model: nn.Module, plans: Sequence[ShardPlan]) -> list[list[int]]:
    """For each trainable parameter (in `trainable_parameters` order): the shards holding
    a slice of it (two or more for a tensor split between shards)."""
    out, offset = [], 0
    for _, param in trainable_parameters(model):
        end = offset + param.numel()
        out.append([p.shard for p in plans if p.offset < end and offset < p.offset + p.numel])
        offset = end
    return out


class ShardTrigger:
    """Launches each shard once backward has produced its whole gradient.

    Args:
        model: the worker's model (hooks are added to its trainable parameters, for the
            life of the worker).
        plans: the run's shard plans, in shard order.
    Raises:
        ValueError: the plans do not cover the model's parameters (another model).
    """

    def __init__(self, model: nn.Module, plans: Sequence[ShardPlan]):
        self.shards_of = shards_of_parameters(model, plans)
        self.num_shards = len(plans)
        self.needed = [0] * self.num_shards
        for shards in self.shards_of:
            for s in shards:
                self.needed[s] += 1
        if any(n == 0 for n in self.needed):
            raise ValueError("a shard holds no parameter of this model; start servers and workers with "
                             "the same model")
        self._left: list[int] = []
        self._launch: Callable[[int], None] | None = None
        self._handles = [param.register_post_accumulate_grad_hook(self._hook(i))
                         for i, (_, param) in enumerate(trainable_parameters(model))]

    def arm(self, launch: Callable[[int], None]) -> None:
        """Call `launch(shard)` from the backward pass to come, once per shard, as soon as
        every parameter of the shard has its gradient (on the thread running backward)."""
        self._left = list(self.needed)
        self._launch = launch

    def disarm(self) -> list[int]:
        """Stop launching; the shards not launched (some parameter took no gradient, or
        backward did not run), in reverse order, as backward would have launched them."""
        self._launch = None
        waiting = [s for s in range(self.num_shards) if self._left and self._left[s] > 0]
        self._left = []
        return waiting[::-1]

    def _hook(self, index: int) -> Callable:
        shards = self.shards_of[index]

        def hook(_param) -> None:
            launch = self._launch
            if launch is None:
                return
            for s in shards:
                self._left[s] -= 1
                if self._left[s] == 0:
                    launch(s)

        return hook

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def overlapped_s(intervals: Sequence[tuple[float, float]], computed: float) -> float:
    """Seconds of one step's pushes, each (launched, answered), in flight before
    `computed` (the time the backward pass ended): their union, overlaps counted once."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted((a, min(b, computed)) for a, b in intervals if a < computed):
        start = max(start, covered_to)
        if end > start:
            total += end - start
            covered_to = end
    return total
