"""How a worker trades gradients for parameters in each aggregation mode.

- `sync`: push to every shard and, at the same time, long-poll each shard for the next
  version; the step ends when the servers have applied it and the worker holds it.
- `async`: pull the newest parameters into a staging buffer while computing (prefetch),
  push, then switch to the prefetched parameters.
- `ssp`: like async, but a push the server rejects as too stale is recomputed on fresh
  parameters and sent again to the shards that rejected it. Prefetched parameters are
  used only when they are fresh enough that the next gradient should stay within the
  bound; otherwise the worker pulls anew after pushing.

With compression on, each mode compresses the gradient before its push (off the
communication phase, as `time/compression_s`) and keeps the error-feedback residuals of
the payloads the servers took.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from disttrain.metrics.window import StepTimer
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.client import PSClient
from disttrain.strategies.ps.payloads import GradientEncoder
from disttrain.training.engine import StepResult

STALE = pb.PushReply.Outcome.Value("STALE")


class Exchange:
    """Shared state of every mode: the versions this worker holds, per shard."""

    def __init__(self, client: PSClient, worker_id: str, flat: torch.Tensor, grads: torch.Tensor,
                 staleness_bound: int, encoder: GradientEncoder | None = None):
        self.client = client
        self.encoder = encoder
        self.worker_id = worker_id
        self.flat = flat
        self.grads = grads
        self.staleness_bound = staleness_bound
        self.num_shards = len(client.shards)
        self.versions = [0] * self.num_shards
        self.num_rejected = 0

    def start(self) -> None:
        """Pull the initial parameters."""
        self.versions = self.client.pull(self.worker_id, self.flat, [0] * self.num_shards)

    def refresh(self) -> None:
        """Hold the servers' newest parameters (before an evaluation)."""
        self.versions = self.client.pull(self.worker_id, self.flat, self.versions)

    def prepare(self, step: int, block_id: int, num_samples: int, shards: list[int], timer: StepTimer
                ) -> Callable[[], list[pb.PushReply]]:
        """The push of the gradient now in `grads` to `shards`, compressed first where the run
        compresses; call the result to send it."""
        headers = [pb.GradientMessage(worker_id=self.worker_id, step=step, base_version=self.versions[s],
                                      block_id=block_id, shard=s, num_samples=num_samples)
                   for s in shards]
        if self.encoder is None:
            return lambda: self.client.push(headers, self.grads, shards)
        with timer.phase("compression"):
            payloads = self.encoder.encode(self.grads, shards)
        for header in headers:
            header.compressed, header.compression_type = True, self.encoder.scheme

        def push() -> list[pb.PushReply]:
            replies = self.client.push(headers, self.grads, shards, payloads)
            self.encoder.commit(payloads, replies)
            return replies

        return push

    def step(self, compute: Callable[[], StepResult], step: int, block_id: int, num_samples: int,
             timer: StepTimer) -> tuple[StepResult, int]:
        """Compute one gradient and trade it. Returns the step's result and its staleness."""
        raise NotImplementedError


class SyncExchange(Exchange):
    def step(self, compute, step, block_id, num_samples, timer):
        result = compute()
        shards = list(range(self.num_shards))
        push = self.prepare(step, block_id, num_samples, shards, timer)
        wanted = [v + 1 for v in self.versions]
        with timer.phase("comm_blocked"):
            replies, versions = self.client.gather([
                push, lambda: self.client.pull(self.worker_id, self.flat, wanted)])
        self.versions = versions
        return result, max(r.staleness for r in replies)

    def refresh(self) -> None:
        """The parameters pulled at the end of each step are already the servers' newest."""


class AsyncExchange(Exchange):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.staged = torch.empty_like(self.flat)

    def prefetch(self) -> Future:
        current = list(self.versions)
        return self.client.submit(lambda: self.client.pull(self.worker_id, self.staged, current))

    def use_prefetched(self, fetched: Future) -> None:
        self.versions = fetched.result()
        self.flat.copy_(self.staged)

    def step(self, compute, step, block_id, num_samples, timer):
        fetched = self.prefetch()
        result = compute()
        push = self.prepare(step, block_id, num_samples, list(range(self.num_shards)), timer)
        with timer.phase("comm_blocked"):
            replies = push()
            self.use_prefetched(fetched)
        return result, max(r.staleness for r in replies)


class SSPExchange(AsyncExchange):
    def step(self, compute, step, block_id, num_samples, timer):
        fetched = self.prefetch()
        pending = list(range(self.num_shards))
        staleness = 0
        while True:
            result = compute()
            push = self.prepare(step, block_id, num_samples, pending, timer)
            with timer.phase("comm_blocked"):
                replies = push()
            staleness = max([staleness] + [r.staleness for r in replies if r.outcome != STALE])
            stale = [s for s, r in zip(pending, replies, strict=True) if r.outcome == STALE]
            if not stale:
                break
            self.num_rejected += len(stale)
            with timer.phase("comm_blocked"):
                if fetched is not None:
                    fetched.result()  # let the prefetch finish before pulling over it
                self.versions = self.client.pull(self.worker_id, self.flat, self.versions)
            fetched, pending = None, stale
        with timer.phase("comm_blocked"):
            acked = {s: r.version for s, r in zip(pending, replies, strict=True)}
            if fetched is None:
                self.versions = self.client.pull(self.worker_id, self.flat, self.versions)
                return result, staleness
            prefetched = fetched.result()
            # The next gradient is computed on these parameters; each later update adds one.
            lag = max(acked.get(s, v) - v for s, v in enumerate(prefetched))
            if lag < self.staleness_bound:
                self.versions = prefetched
                self.flat.copy_(self.staged)
            else:
                self.versions = self.client.pull(self.worker_id, self.flat, self.versions)
        return result, staleness


def make_exchange(mode: str, client: PSClient, worker_id: str, flat: torch.Tensor, grads: torch.Tensor,
                  staleness_bound: int, encoder: GradientEncoder | None = None) -> Exchange:
    """The exchange of aggregation mode `mode` ("sync", "async" or "ssp"); `encoder`
    compresses each push (None: raw values)."""
    classes = {"sync": SyncExchange, "async": AsyncExchange, "ssp": SSPExchange}
    if mode not in classes:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    return classes[mode](client, worker_id, flat, grads, staleness_bound, encoder)
