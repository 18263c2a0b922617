"""Retries back off exponentially up to a cap, with jitter, over real gRPC calls: a
parameter-server worker's RPCs (`ShardClient`) and a node's registration with the
coordinator (`CoordinatorClient.register`). The servers are real gRPC servers on port 0
that answer UNAVAILABLE a few times (a server restarting) before they answer; the waits
are read through the retry's `sleep` seam, so no test waits them out."""

from __future__ import annotations

import socket
from dataclasses import replace

import grpc
import pytest

from disttrain.coordinator import client as coordinator_client
from disttrain.coordinator.client import CoordinatorClient
from disttrain.core.errors import DistributedError
from disttrain.core.rpc_server import RpcServer, ServerLimits
from disttrain.proto import coordinator_pb2
from disttrain.proto import parameter_server_pb2 as ps_pb
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.worker.retry import RetryPolicy
from disttrain.strategies.ps.worker.shard_client import ShardClient

pytestmark = pytest.mark.timeout(60)

NUM_FAILURES = 8  # enough for both policies' waits to reach their cap


class Restarting:
    """A real gRPC server whose one method answers UNAVAILABLE `failures` times, then `reply`."""

    def __init__(self, service: str, method: str, request_type, reply, failures: int):
        self.failures, self.reply, self.num_calls = failures, reply, 0
        handler = grpc.unary_unary_rpc_method_handler(
            self._answer, request_deserializer=request_type.FromString,
            response_serializer=type(reply).SerializeToString)
        self.server = RpcServer(grpc.method_handlers_generic_handler(service, {method: handler}), service,
                                "127.0.0.1:0", ServerLimits(4))
        self.address = self.server.address

    def _answer(self, request, context):
        self.num_calls += 1
        if self.num_calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return self.reply

    def __enter__(self) -> Restarting:
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0)


def assert_backoff(waits: list[float], initial_s: float, max_s: float) -> None:
    """Wait n lies in [b_n, b_n + initial_s], b_n = min(initial_s * 2**n, max_s): it doubles
    up to the cap, plus a jitter of at most one initial backoff, which is not the same for
    every wait (a constant would not spread many clients' retries)."""
    bases = [min(initial_s * 2 ** n, max_s) for n in range(len(waits))]
    assert bases[-1] == max_s, "too few waits to reach the cap"
    jitters = [wait - base for wait, base in zip(waits, bases, strict=True)]
    assert all(-1e-9 <= jitter <= initial_s + 1e-9 for jitter in jitters), (waits, bases)
    assert len({round(jitter, 9) for jitter in jitters}) > 1, f"no jitter: {waits}"


def shard_status_after_restart(policy: RetryPolicy) -> tuple[ps_pb.ShardStatus, list[float], int]:
    """GetStatus through a worker's channel to a shard server that restarts meanwhile:
    its answer, the waits between attempts, and the number of attempts."""
    waits: list[float] = []
    with Restarting(wire.SERVICE, "GetStatus", ps_pb.StatusRequest, ps_pb.ShardStatus(version=7),
                    NUM_FAILURES) as server:
        channel = ShardClient(server.address, 0, replace(policy, sleep=waits.append))
        try:
            status = channel.unary("GetStatus", ps_pb.StatusRequest())
        finally:
            channel.close()
        return status, waits, server.num_calls


def test_a_worker_retries_a_restarting_server_with_growing_jittered_waits():
    policy = RetryPolicy(timeout_s=5.0)  # the worker's backoff: the defaults
    status, waits, num_calls = shard_status_after_restart(policy)
    assert status.version == 7
    assert num_calls == NUM_FAILURES + 1
    assert len(waits) == NUM_FAILURES
    assert_backoff(waits, policy.initial_backoff_s, policy.max_backoff_s)
    _, other_waits, _ = shard_status_after_restart(policy)
    assert other_waits != waits  # two workers retrying at once do not retry in step


def test_a_worker_gives_up_after_its_attempts_on_a_port_where_nothing_listens():
    waits: list[float] = []
    policy = RetryPolicy(timeout_s=0.05, max_attempts=6, initial_backoff_s=0.01, max_backoff_s=0.08,
                         sleep=waits.append)
    with socket.socket() as unused:  # bound, never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        channel = ShardClient(f"127.0.0.1:{unused.getsockname()[1]}", 0, policy)
        try:
            with pytest.raises(DistributedError, match="GetStatus on shard 0"):
                channel.unary("GetStatus", ps_pb.StatusRequest())
        finally:
            channel.close()
    assert len(waits) == policy.max_attempts - 1
    assert_backoff(waits, policy.initial_backoff_s, policy.max_backoff_s)


def registration_after_restart() -> tuple[coordinator_pb2.RegisterNodeReply, list[float]]:
    waits: list[float] = []
    reply = coordinator_pb2.RegisterNodeReply(generation=3)
    with Restarting(coordinator_client.SERVICE, "RegisterNode", coordinator_pb2.RegisterNodeRequest, reply,
                    NUM_FAILURES) as server:
        client = CoordinatorClient(server.address, timeout_s=5.0)
        try:
            answer = client.register("worker-0", "worker", rank=0, retry_s=60.0, sleep=waits.append)
        finally:
            client.close()
        assert server.num_calls == NUM_FAILURES + 1
    return answer, waits


def test_registration_retries_a_restarting_coordinator_with_growing_jittered_waits():
    reply, waits = registration_after_restart()
    assert reply.generation == 3
    assert len(waits) == NUM_FAILURES
    assert_backoff(waits, 0.05, 2.0)  # register's backoff: 50 ms doubling to 2 s, jitter up to 50 ms
    _, other_waits = registration_after_restart()
    assert other_waits != waits
