"""Local-update training on DDP ranks: the transport around `training.local_updates`.

A rank in this mode trains its plain module (no DDP wrapper: no gradient all-reduce, and
no broadcast of buffers before each forward, so the steps inside a round touch no
network). At a round's end it averages the pseudo-gradient over the ranks in one flat
all-reduce (or through the run's compression hook, which sees it as one bucket of every
parameter, so quantization, top-k with error feedback, PowerSGD and half precision
compress it as they compress gradients), every rank applies the outer optimizer alike,
and the buffers (BatchNorm's running statistics) are broadcast from rank 0, as DDP
broadcasts them before every forward: the buffers a round ends with are rank 0's.

With Streaming DiLoCo's fragments (`training.fragments`) a step may end the round of one
fragment: its pseudo-gradient alone is averaged, as above; an epoch's last step averages
every fragment's, one exchange each. With `training.outer_delay` tau the average is an
asynchronous collective whose result the rank waits for tau inner steps later (the
buffers are broadcast at the step it lands); a checkpoint in between waits for it and
keeps the average (`StreamingRounds.state_dict`). With `training.outer_compression` the average is an
all-gather of each rank's fp16 or int8 payload (the compression hooks' `GatherHook`, with
error feedback), each rank's residuals its own (in its `local_state`).

Between two rounds the ranks' models and inner optimizers differ, so a checkpoint keeps
each rank's own (`local_state`, gathered per rank like RNG states) beside the outer
state (the same on every rank; rank 0's). A resumed run continues the round where the
checkpoint left it; a rank lost mid-round sends every rank back to that checkpoint, and
the steps after it are redone on the same batches (the sampler's position is in it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from disttrain.compression.ddp_hooks import CompressionHook, GatherHook, start_average
from disttrain.strategies.ddp.comm_hooks import CommSample
from disttrain.training.fragments import StreamingRounds, outer_compressor
from disttrain.training.local_updates import LocalUpdates

logger = logging.getLogger(__name__)


@torch.no_grad()
def broadcast_module(module: nn.Module, parameters: bool = True) -> None:
    """Rank 0's buffers (and parameters) on every rank, as DDP's constructor does. A collective."""
    tensors = [*(module.parameters() if parameters else ()), *module.buffers()]
    for tensor in tensors:
        dist.broadcast(tensor.data, src=0)


class _Average:
    """The ranks' mean of a pseudo-gradient under way (`ddp_hooks.start_average`), with the
    times it was started and finished (`finished`: when it ended, or now while running)."""

    def __init__(self, delta: torch.Tensor, params: list[nn.Parameter], compression: CompressionHook | None):
        self.started = time.perf_counter()
        self._finished: float | None = None

        def finish(done: torch.futures.Future) -> torch.Tensor:
            self._finished = time.perf_counter()
            return done.value()

        self._future = start_average(delta, params, compression).then(finish)

    @property
    def finished(self) -> float:
        return self._finished if self._finished is not None else time.perf_counter()

    def wait(self) -> torch.Tensor:
        return self._future.wait()


class LocalRounds:
    """One rank's rounds: counts its steps, and at a round's end averages, steps the outer
    optimizer and hands back the round's figures.

    Args:
        settings: H and the outer optimizer.
        module: the rank's plain model, already on its device, the same on every rank
            (`broadcast_module` makes it so in restart mode; a live group hands its state
            over); a round starts at its parameters.
        compression: the run's compression hook, or None for a plain all-reduce.
    """

    def __init__(self, settings: LocalUpdates, module: nn.Module, compression: CompressionHook | None):
        self.settings = settings
        self.module = module
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.outer = StreamingRounds(settings, self.params, [name for name, _ in named])
        compressor = outer_compressor(settings)
        if compressor is not None:  # the config refuses it beside the run's compression
            # Residuals by the fragments' tensors (a part of a parameter is named as such).
            names = {id(tensor): name for fragment in self.outer.fragments
                     for tensor, name in zip(fragment.tensors, fragment.names, strict=True)}
            compression = GatherHook(compressor, names)
        self.compression = compression
        self.own_compression = compressor is not None  # its state goes with the rank's own

    def end_of_step(self, ends_epoch: bool) -> dict[str, float]:
        """Call after each inner optimizer step (on every rank: a collective at a round's
        end). Returns the step's communication figures (zero within a round):
        `comm/bytes_allreduced` and `local/exchange_bytes` (the largest exchange's dense
        bytes) at the step an exchange starts; `time/comm_blocked_s` the time the step spent
        starting, waiting for and applying exchanges; `time/comm_overlapped_s` the time
        delayed exchanges that landed at this step ran beside inner steps."""
        rounds, started = self.outer.rounds, time.perf_counter()
        num_bytes, largest = 0, 0
        due = self.outer.end_of_step(ends_epoch)
        landed = self.outer.land(ends_epoch)
        overlapped = sum(max(0.0, min(exchange.average.finished, started) - exchange.average.started)
                         for exchange in landed if isinstance(exchange.average, _Average))
        for fragment in due:
            delta = self.outer.pseudo_gradient(fragment)
            # averaged over the ranks in place where the scheme allows, the same bits on every rank
            average = _Average(delta, cast(list[nn.Parameter], fragment.tensors), self.compression)
            self.outer.send(fragment, average, ends_epoch)
            num_bytes += fragment.nbytes()
            largest = max(largest, fragment.nbytes())
        if due or landed:
            broadcast_module(self.module, parameters=False)
        blocked = time.perf_counter() - started if due or landed else 0.0
        scalars = {**CommSample(blocked, overlapped, num_bytes).scalars(),
                   "local/rounds": self.outer.rounds - rounds, "local/exchange_bytes": largest}
        if self.own_compression:  # the run's own hook, when there is one, is drained by the rank
            assert self.compression is not None
            scalars.update(self.compression.stats.drain().scalars())
        return scalars

    @property
    def rounds(self) -> int:
        return self.outer.rounds

    def summary_fields(self) -> dict[str, Any]:
        """The summary's local-update fields: the settings and the rounds completed."""
        return {**self.settings.summary_fields(), "local_rounds": self.rounds}

    def local_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """This rank's own: its model (parameters and buffers) and its inner optimizer's
        tensors, named `model/<name>` and `optimizer/<index>/<key>`."""
        state = {f"model/{name}": value for name, value in self.module.state_dict().items()}
        if self.own_compression:  # this rank's error-feedback residuals
            assert self.compression is not None
            state.update({f"outer_compression/{name}": value
                          for name, value in self.compression.state_dict().items()})
        for index, entries in optimizer.state_dict()["state"].items():
            state.update({f"optimizer/{index}/{key}": value for key, value in entries.items()
                          if isinstance(value, torch.Tensor)})
        return state

    def load_local_state(self, local: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
                         ) -> dict[str, Any]:
        """Load this rank's model from `local`; returns `optimizer_state` (rank 0's inner
        optimizer, as the checkpoint holds it) with this rank's tensors in place of rank 0's.

        Raises:
            ValueError: `local` lacks a tensor the model or the optimizer state needs.
        """
        model = {name[len("model/"):]: value for name, value in local.items() if name.startswith("model/")}
        self.module.load_state_dict(model)
        if self.own_compression:
            assert self.compression is not None
            prefix = "outer_compression/"
            own = {name[len(prefix):]: value for name, value in local.items() if name.startswith(prefix)}
            if not own:
                raise ValueError("it was written without training.outer_compression; resume with "
                                 "training.outer_compression none")
            self.compression.load_state_dict(own)
        own = {index: dict(entries) for index, entries in optimizer_state["state"].items()}
        for index, entries in own.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    name = f"optimizer/{index}/{key}"
                    if name not in local:
                        raise ValueError(f"this rank's inner optimizer state lacks {name}")
                    entries[key] = local[name]
        return {**optimizer_state, "state": own}
