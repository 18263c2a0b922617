"""The worker's side of the wire: every shard of a run, registered together, with
pushes and pulls fanned out to all shards at once on a small thread pool."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from disttrain.compression import Encoded
from disttrain.config.schema import PAYLOAD_TRANSPORTS
from disttrain.core.credentials import Credentials
from disttrain.core.errors import DistributedError
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire import service, shared_memory
from disttrain.strategies.ps.wire.codec import CHUNK_BYTES, tensor_bytes
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import ShardPlan
from disttrain.strategies.ps.worker.overlap import Written
from disttrain.strategies.ps.worker.retry import RetryPolicy
from disttrain.strategies.ps.worker.shard_client import ROLLED_BACK, ShardClient

logger = logging.getLogger(__name__)

__all__ = ["PSClient", "RetryPolicy", "ShardClient"]

RESTART_CHECK_S = 1.0  # how often a worker waiting at a barrier checks the other shards for a restart


class PSClient:
    """All shards of a run, with their plans; calls fan out concurrently.

    Args:
        addresses: "host:port" of each shard's server, in shard order.
        plans: the worker's own shard plans (checked against the servers' at register).
        credentials: the run's token, sent with every call (None: the servers run open), and
            the TLS files to reach the servers with (None or empty: plain TCP).
        one_round_trip: trade a gradient for parameters in one call per shard (`step`)
            where the payload allows; False: a push and a pull each time.
    """

    def __init__(self, addresses: list[str], plans: list[ShardPlan], policy: RetryPolicy,
                 transport: str = "auto", credentials: Credentials | None = None,
                 one_round_trip: bool = True):
        if len(addresses) != len(plans):
            raise ValueError(f"{len(addresses)} server addresses for {len(plans)} shards")
        if transport not in PAYLOAD_TRANSPORTS:
            raise ValueError(f"payload transport {transport!r} is not one of {', '.join(PAYLOAD_TRANSPORTS)}")
        self.plans = plans
        self.transport = transport
        self.one_round_trip = one_round_trip
        credentials = credentials or Credentials()
        self.shards = [ShardClient(a, i, policy, credentials.token, credentials.tls)
                       for i, a in enumerate(addresses)]
        self._pool = ThreadPoolExecutor(max(2 * len(addresses), 2), thread_name_prefix="ps-client")
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bytes_received_dense = 0  # what the parameters received would have taken dense

    def _count(self, sent: int = 0, received: int = 0, dense: int | None = None) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.bytes_received_dense += received if dense is None else dense

    def compress_pulls(self, scheme: str, ratio: float) -> None:
        """Take pull compression's changes (`scheme`, topk's `ratio`) from every shard."""
        for shard, plan in zip(self.shards, self.plans, strict=True):
            shard.changes = ParameterChanges(plan, scheme, ratio)

    def gather(self, calls: list[Callable[[], object]]) -> list:
        """Run `calls` concurrently (the first on this thread); raise the first failure at once."""
        futures = [self._pool.submit(call) for call in calls[1:]]
        try:
            first = calls[0]()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
        return [first] + [f.result() for f in futures]

    def submit(self, call: Callable[[], object]):
        return self._pool.submit(call)

    def register(self, worker_id: str, requested_rank: int = -1, generation: int = 0,
                 key: bytes | None = None) -> pb.WorkerAssignment:
        """Register with shard 0 (which assigns the rank), then with the others under it.

        Args:
            generation: the membership generation the worker joined the coordinator in.
            key: the worker's key (see `run.worker.worker_key`); None: a new random one.
        Raises:
            DistributedError: a server's layout differs from this worker's model, the
                servers disagree on the run's shape, or another worker holds the id.
        """
        wants_memory = self.transport != "grpc" and shared_memory.available()
        if self.transport == "shared_memory" and not wants_memory:
            raise DistributedError("ps.payload_transport is shared_memory, but this machine has "
                                   f"no writable {shared_memory.SEGMENT_DIR}; use auto or grpc")
        request = pb.RegisterRequest(worker_id=worker_id, requested_rank=requested_rank,
                                     hostname=socket.gethostname(), pid=os.getpid(),
                                     shared_memory=wants_memory, generation=generation,
                                     key=key if key is not None else secrets.token_bytes(32))
        required = self.transport == "shared_memory"
        first = self.shards[0].join(request, self.plans[0], len(self.shards), required)
        request.requested_rank = first.rank
        rest = self.gather([lambda s=s: s.join(request, self.plans[s.shard], len(self.shards), required)
                            for s in self.shards[1:]]) if len(self.shards) > 1 else []
        for assignment in rest:
            shape = (assignment.world_size, assignment.aggregation_mode, assignment.staleness)
            if shape != (first.world_size, first.aggregation_mode, first.staleness):
                raise DistributedError("the servers were started with different configs")
        return first

    def pull(self, worker_id: str, flat: torch.Tensor, min_versions: list[int],
             shards: list[int] | None = None, policy: RetryPolicy | None = None) -> list[int]:
        """Copy the parameters of `shards` (default: all; each once at its min version in
        `min_versions`, which has one entry per shard of the run) into `flat`; returns
        `min_versions` with the versions pulled in place. A shard that restarted answers
        with the (lower) version it came back at. `policy`: deadlines and retries other
        than the shards' own."""
        shards = list(range(len(self.shards))) if shards is None else shards
        plans = self.plans
        results = self.gather([
            lambda s=s: self.shards[s].pull(worker_id, plans[s], min_versions[s],
                                            flat[plans[s].offset:plans[s].offset + plans[s].numel], policy)
            for s in shards])
        self._count(received=sum(r[1] for r in results))
        versions = list(min_versions)
        for s, (version, _) in zip(shards, results, strict=True):
            versions[s] = version
        return versions

    def _body(self, grads: torch.Tensor, shard: int, payload: Encoded | None) -> memoryview:
        """What a push to `shard` carries: its compressed payload, or its slice of `grads`."""
        if payload is not None:
            return memoryview(payload.data)
        plan, size = self.plans[shard], grads.element_size()
        return tensor_bytes(grads)[plan.offset * size:(plan.offset + plan.numel) * size]

    def push(self, headers: list[pb.GradientMessage], grads: torch.Tensor, shards: list[int],
             payloads: list[Encoded] | None = None) -> list[pb.PushReply]:
        """Push `grads` (the flat gradient) to `shards`, each with its header; or, when
        `payloads` are given, those compressed payloads (one per shard in `shards`)."""
        payloads = payloads or [None] * len(shards)
        results = self.gather([
            lambda h=h, s=s, p=p: self.shards[s].push(h, self.plans[s], self._body(grads, s, p))
            for h, s, p in zip(headers, shards, payloads, strict=True)])
        self._count(sent=sum(r[1] for r in results))
        return [r[0] for r in results]

    def step(self, headers: list[pb.GradientMessage], grads: torch.Tensor, shards: list[int],
             flat: torch.Tensor, min_versions: list[int], payloads: list[Encoded] | None = None
             ) -> tuple[list[pb.PushReply], list[int | None]]:
        """Push to `shards` as `push` does and copy the parameters each push leads to into
        `flat`: in one round trip per shard (Step) where the payload allows (see
        `can_step`), else a push, then a pull at `min_versions[s]`. Returns the replies and, per shard
        of the run, the version now in `flat` (None: untouched, as for a ROLLED_BACK push
        or a shard not in `shards`)."""
        payloads = payloads or [None] * len(shards)
        results = self.gather([lambda h=h, s=s, p=p: self._trade(h, s, self._body(grads, s, p), flat,
                                                                 min_versions)
                               for h, s, p in zip(headers, shards, payloads, strict=True)])
        return self._traded(shards, results)

    def step_streamed(self, header: pb.GradientMessage, grads: torch.Tensor, shard: int,
                      flat: torch.Tensor, min_versions: list[int], written: Written
                      ) -> tuple[list[pb.PushReply], list[int | None]]:
        """`step` of one shard's raw gradient that backward is still writing (the shard
        `streams`): the push streams it as `written` says, then the pull."""
        return self._traded([shard], [self._trade(header, shard, self._body(grads, shard, None), flat,
                                                  min_versions, written)])

    def _trade(self, header: pb.GradientMessage, s: int, body: memoryview, flat: torch.Tensor,
               min_versions: list[int], written: Written | None = None) -> tuple:
        """One shard's push of `body` and the parameters it leads to (see `step`):
        (reply, version or None, bytes sent, received, received as dense)."""
        plan, shard = self.plans[s], self.shards[s]
        into = flat[plan.offset:plan.offset + plan.numel]
        if self.can_step(s):
            reply, version, sent, received = shard.step(header, plan, body, into)
            return reply, version, sent, received, 0 if version is None else plan.nbytes
        reply, sent = shard.push(header, plan, body, written)
        if reply.outcome == ROLLED_BACK:
            return reply, None, sent, 0, 0
        version, received = shard.pull(header.worker_id, plan, min_versions[s], into)
        return reply, version, sent, received, received

    def _traded(self, shards: list[int], results: list[tuple]) -> tuple[list[pb.PushReply], list[int | None]]:
        """The replies and versions of `_trade`s to `shards`, their bytes counted."""
        self._count(sent=sum(r[2] for r in results), received=sum(r[3] for r in results),
                    dense=sum(r[4] for r in results))
        versions: list[int | None] = [None] * len(self.shards)
        for s, result in zip(shards, results, strict=True):
            versions[s] = result[1]
        return [r[0] for r in results], versions

    def shared_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The single shard's parameter and gradient segments, for the worker's model to
        live in, when it trades every step in one round trip through shared memory: its
        gradients then reach the server and its parameters come back without a copy on
        the worker. None with several shards (their segments are separate mappings), over
        gRPC, or without one round trip (the prefetching exchange would be written to
        while it computes)."""
        if len(self.shards) != 1 or not self.can_step(0) or self.shards[0].segments is None:
            return None
        segments = self.shards[0].segments
        return segments.parameter_tensor, segments.gradient_tensor

    def streams(self, shard: int) -> bool:
        """Whether a raw push to `shard` can leave piece by piece while backward still
        writes it: its bytes travel in gRPC messages, more than one piece of them, and the
        push goes apart from the pull (not in one Step round trip, which carries one
        message)."""
        return not self.can_step(shard) and self.shards[shard].segments is None \
            and self.plans[shard].nbytes > CHUNK_BYTES

    def can_step(self, shard: int) -> bool:
        """Whether a step on `shard` goes in one round trip."""
        client = self.shards[shard]
        return self.one_round_trip and (
            client.segments is not None or service.fits_one_message(self.plans[shard].nbytes))

    def barrier(self, worker_id: str, name: str, values: list[float] = (), step: int = 0
                ) -> list[list[float]]:
        """Meet every worker at barrier `name` (on shard 0); every worker's values, in rank
        order. Waits as long as the slowest worker takes, retrying each deadline; a
        barrier of a `step` is given up instead when a worker is behind: then [].

        While it waits, the other shards are watched (`watch_restarts`): one restored meanwhile
        may have lost this worker's last push of an epoch, and a worker still training that
        epoch waits on it for this one."""
        stop = threading.Event()
        watcher = self._pool.submit(self.watch_restarts, stop) if len(self.shards) > 1 else None
        try:
            reply = self.shards[0].unary("Barrier", pb.BarrierRequest(worker_id=worker_id, name=name,
                                                                      values=list(values), step=step))
        finally:
            stop.set()
            if watcher is not None:
                watcher.result()
        width = len(reply.values) // max(reply.world_size, 1)
        return [list(reply.values[r * width:(r + 1) * width]) for r in range(reply.world_size)]

    def watch_restarts(self, stop: threading.Event, interval_s: float = RESTART_CHECK_S) -> None:
        """Until `stop`, every `interval_s`: register again with each shard but shard 0 that
        restarted (`ShardClient.check_restart`), telling it the epochs this worker has
        trained to their end (`finished_epochs`)."""
        while not stop.wait(interval_s):
            for shard in self.shards[1:]:
                shard.check_restart(interval_s)

    def finished_epochs(self, count: int) -> None:
        """This worker has trained `count` epochs to their end: every registration says so
        from now on (see `RegisterRequest.epochs_done`)."""
        for shard in self.shards:
            shard.epochs_done = max(shard.epochs_done, count)

    def worker_done(self, worker_id: str) -> list[pb.ShardStatus]:
        """Tell every shard this worker finished training; their statuses."""
        return self.call_all("WorkerDone", pb.WorkerDoneRequest(worker_id=worker_id))

    def lose_next_replies(self) -> None:
        """Fault injection: the next push's replies never arrive (the pushes do)."""
        for shard in self.shards:
            shard.drop_replies += 1

    def ledger(self, first: int, end: int) -> list[set[int]]:
        """Each shard's applied blocks with ids in [first, end)."""
        replies = self.call_all("GetLedger", pb.LedgerRequest(first_block=first, end_block=end))
        return [set(reply.block_ids) for reply in replies]

    def call_all(self, name: str, request, timeout_s: float | None = None) -> list:
        return self.gather([lambda s=s: s.unary(name, request, timeout_s) for s in self.shards])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for shard in self.shards:
            shard.close()
