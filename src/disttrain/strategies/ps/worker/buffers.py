"""A worker's model buffers under the parameter server (BatchNorm running statistics and
batch counters): taken from the shards with the parameters, and the change each step
makes to them sent back with its gradient.

The servers hold the model's buffers (see `server.shard` for the rule they follow); a
worker's copies are the servers' at the parameters' version it computes on, plus what its
own forward passes add. So before each gradient the worker takes the buffers that came
with the parameters it holds (`adopt`), notes them (`begin`), and after the forward and
backward pass keeps the difference (`finish`), which its push carries to each shard.
Evaluation and the final model take the servers' buffers the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.wire.service import buffer_proto
from disttrain.strategies.ps.wire.sharding import ShardPlan
from disttrain.strategies.ps.worker.shard_client import ShardClient


class WorkerBuffers:
    """The model's buffers, by the shard holding each.

    Args:
        model: the worker's model (its buffers are updated in place).
        plans: the run's shard plans, in shard order.
        shards: the clients of those shards, whose `buffers` hold what the last answer brought.
    Raises:
        ValueError: a plan names a buffer the model lacks (another model).
    """

    def __init__(self, model: nn.Module, plans: Sequence[ShardPlan], shards: Sequence[ShardClient]):
        named = dict(model.named_buffers())
        missing = [b.name for plan in plans for b in plan.buffers if b.name not in named]
        if missing:
            raise ValueError(f"the shard plan names buffers {missing} the model does not have")
        self.shards = list(shards)
        self.tensors = [[named[b.name] for b in plan.buffers] for plan in plans]
        self._before: list[torch.Tensor | None] = [None] * len(self.tensors)
        self._changes = [torch.zeros(plan.buffer_numel, dtype=torch.float64) for plan in plans]
        self._adopted: list[torch.Tensor | None] = [None] * len(self.tensors)

    @property
    def any(self) -> bool:
        """Whether the model has buffers the servers keep."""
        return any(self.tensors)

    def adopt(self) -> None:
        """Take the buffers that came with the newest parameters from each shard (those
        already taken are not copied again)."""
        for shard, tensors in enumerate(self.tensors):
            received = self.shards[shard].buffers
            if not tensors or received is None or received is self._adopted[shard]:
                continue
            offset = 0
            with torch.no_grad():
                for tensor in tensors:
                    n = tensor.numel()
                    values = received[offset:offset + n].view(tensor.shape)
                    if not tensor.is_floating_point():  # a weighted sum of counts: 2.9999... is 3
                        values = values.round()
                    tensor.copy_(values.to(tensor.dtype))
                    offset += n
            self._adopted[shard] = received

    def begin(self) -> None:
        """Note the buffers before a forward pass (after `adopt`)."""
        self._before = [self._flat(tensors) for tensors in self.tensors]

    def finish(self) -> None:
        """Keep the change the forward pass since `begin` made to each shard's buffers."""
        for shard, tensors in enumerate(self.tensors):
            before = self._before[shard]
            if tensors and before is not None:
                self._changes[shard] = self._flat(tensors) - before

    def change(self, shard: int) -> tensor_pb2.TensorProto | None:
        """What a push to `shard` carries of the buffers (None: the shard holds none)."""
        return buffer_proto(self._changes[shard]) if self.tensors[shard] else None

    @staticmethod
    def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
