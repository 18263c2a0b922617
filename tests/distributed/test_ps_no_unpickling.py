"""Bytes from the network are never unpickled: a pickled object sent as a gradient's
tensor bytes is refused, or read as raw numbers, and its code never runs."""

import os
import pickle

import grpc
import pytest
import torch
from test_ps_server import frames, shard  # noqa: F401  (the fixture)

from disttrain.proto import parameter_server_pb2 as pb

pytestmark = pytest.mark.timeout(60)


class Payload:
    """Unpickling this creates the file named by `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_pickled_object_as_tensor_bytes_is_refused_and_never_unpickled(shard, tmp_path):  # noqa: F811
    server, client, plan, send = shard
    marker = tmp_path / "unpickled"
    before = server.state.parameters()
    with pytest.raises(grpc.RpcError) as raised:
        send(frames(plan, None, data=pickle.dumps(Payload(str(marker)))), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in raised.value.details()
    assert not marker.exists()
    assert server.state.version == 0 and torch.equal(server.state.parameters(), before)


def test_pickled_bytes_of_the_tensors_size_are_read_as_raw_numbers(shard, tmp_path):  # noqa: F811
    server, client, plan, send = shard
    marker = tmp_path / "unpickled"
    pickled = pickle.dumps(Payload(str(marker)))
    data = (pickled * (plan.numel * 4 // len(pickled) + 1))[:plan.numel * 4]
    as_numbers = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if torch.isfinite(as_numbers).all():
        assert send(frames(plan, None, data=data), timeout=10).outcome == pb.PushReply.APPLIED
        assert server.state.version == 1
    else:  # refused like any non-finite gradient
        with pytest.raises(grpc.RpcError) as raised:
            send(frames(plan, None, data=data), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and server.state.version == 0
    assert not marker.exists()
