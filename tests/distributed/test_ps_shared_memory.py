"""The shared-memory payload path of one real shard server, driven over gRPC: the same
validation as bytes on the wire, and the same results."""

import grpc
import pytest
import torch

from disttrain.config import config_from_dict
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import service as wire
from disttrain.strategies.ps.wire import shared_memory
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not shared_memory.available(), reason="no /dev/shm here")]


@pytest.fixture
def cluster(tmp_path):
    """One shard and two clients of one worker each: through shared memory and through gRPC."""
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd",
                     "momentum": 0.0, "learning_rate": 0.5},
        "system": {"num_workers": 2, "aggregation_mode": "async", "checkpoint_dir": str(tmp_path)}})
    server = ShardServer(build_state(config, 0, 1), "127.0.0.1:0")
    plan = plan_shards(init_model(config.training), 1)[0]
    clients = {transport: PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=2),
                                   transport) for transport in ("shared_memory", "grpc")}
    clients["shared_memory"].register("memory")
    clients["grpc"].register("wire")
    yield server, clients, plan
    for client in clients.values():
        client.close()
    server.stop(0)


def push(client, worker_id, plan, gradient, step, version):
    header = pb.GradientMessage(worker_id=worker_id, step=step, base_version=version, shard=0, num_samples=8,
                                block_id=1000 * len(worker_id) + step)
    return client.push([header], gradient, [0])[0]


def test_both_transports_apply_and_pull_the_same_values(cluster):
    server, clients, plan = cluster
    assert clients["shared_memory"].shards[0].segments is not None
    assert clients["grpc"].shards[0].segments is None
    start = server.state.parameters()
    first, second = torch.randn(plan.numel), torch.randn(plan.numel)
    assert push(clients["shared_memory"], "memory", plan, first, 1, 0).version == 1
    assert push(clients["grpc"], "wire", plan, second, 1, 1).version == 2
    expected = start - 0.5 * first - 0.5 * second
    torch.testing.assert_close(server.state.parameters(), expected, rtol=0, atol=1e-6)
    pulled = {name: torch.empty(plan.numel) for name in clients}
    for name, client in clients.items():
        worker_id = "memory" if name == "shared_memory" else "wire"
        assert client.pull(worker_id, pulled[name], [2]) == [2]
    assert torch.equal(pulled["shared_memory"], pulled["grpc"])
    assert torch.equal(pulled["grpc"], server.state.parameters())


def test_nan_in_shared_memory_is_rejected_and_changes_nothing(cluster):
    server, clients, plan = cluster
    before = server.state.parameters()
    poisoned = torch.ones(plan.numel)
    poisoned[3] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        push(clients["shared_memory"], "memory", plan, poisoned, 1, 0)
    assert server.state.version == 0 and torch.equal(server.state.parameters(), before)


def unary_push(client, header):
    call = client.shards[0].channel.unary_unary(wire.method_path("PushGradients"),
                                                request_serializer=wire.identity,
                                                response_deserializer=pb.PushReply.FromString)
    return call(header.SerializeToString(), timeout=10)


def memory_header(plan, worker_id, session, **payload):
    header = pb.GradientMessage(worker_id=worker_id, step=1, base_version=0, shard=0, num_samples=8,
                                shared_memory=True, layout=wire.slice_specs(plan), session=session)
    header.payload.CopyFrom(tensor_pb2.TensorProto(shape=[plan.numel], dtype=plan.dtype, **payload))
    return header


@pytest.mark.parametrize("case, code, words", [
    ("no segments", grpc.StatusCode.FAILED_PRECONDITION, "no shared-memory segments"),
    ("bytes too", grpc.StatusCode.INVALID_ARGUMENT, "also carries"),
])
def test_protocol_breaks_on_the_memory_path_are_refused(cluster, case, code, words):
    server, clients, plan = cluster
    if case == "no segments":  # a worker that never asked for segments claims to use them
        header = memory_header(plan, "wire", clients["grpc"].shards[0].session)
    else:
        header = memory_header(plan, "memory", clients["shared_memory"].shards[0].session, data=b"\0" * 8)
    with pytest.raises(grpc.RpcError) as raised:
        unary_push(clients["grpc"], header)
    assert raised.value.code() == code and words in raised.value.details()
    assert server.state.version == 0


def test_a_shard_too_large_for_one_message_is_fetched_by_stream(cluster, monkeypatch):
    server, clients, plan = cluster
    monkeypatch.setattr(wire, "UNARY_MAX_BYTES", plan.nbytes // 3)
    flat = torch.empty(plan.numel)
    assert clients["grpc"].pull("wire", flat, [0]) == [0]
    assert torch.equal(flat, server.state.parameters())
