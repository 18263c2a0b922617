"""Self-describing top-k payloads (`compression.compact`, DGC's warm-up) pushed to a shard
server on a real socket (port 0), over gRPC bytes and over shared memory (where the
server reads the most bytes a payload can take): the server applies exactly what the
payload decodes to, and refuses a malformed one with INVALID_ARGUMENT, leaving
parameters, version and optimizer state as they were."""

from __future__ import annotations

import struct

import pytest
import torch

from disttrain.compression import Compressor
from disttrain.config import config_from_dict
from disttrain.core.errors import DistributedError
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import shared_memory
from disttrain.strategies.ps.wire.payloads import shard_segments
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
LEARNING_RATE = 0.5
TRANSPORTS = ["grpc"] + (["shared_memory"] if shared_memory.available() else [])
COMPRESSION = {"enabled": True, "type": "topk", "ratio": 0.05, "compact": True}


@pytest.fixture(params=TRANSPORTS)
def shard(request, tmp_path):
    config = config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd",
                     "momentum": 0.0, "learning_rate": LEARNING_RATE, "checkpoint_interval": 1000},
        "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt")},
        "compression": COMPRESSION})
    state = build_state(config, 0, 1)
    server = ShardServer(state, "127.0.0.1:0")
    plan = plan_shards(init_model(config.training), 1)[0]
    client = PSClient([server.address], [plan], RetryPolicy(timeout_s=10.0, max_attempts=1), request.param)
    client.register("w0")
    yield state, plan, client, Compressor.from_config(config.compression, 0)
    client.close()
    server.stop(0)


def push(client: PSClient, plan, state, data: bytes, step: int) -> pb.PushReply:
    header = pb.GradientMessage(worker_id="w0", step=step, base_version=state.version, shard=0,
                                num_samples=8, block_id=step, compressed=True, compression_type="topk")
    reply, _ = client.shards[0].push(header, plan, memoryview(data))
    return reply


def test_the_server_applies_exactly_the_decoded_compact_gradient(shard):
    state, plan, client, compressor = shard
    segments = shard_segments(plan)
    for step in (1, 2):  # the second, shorter or longer, over the first's bytes in shared memory
        gradient = torch.randn(plan.numel, generator=torch.Generator().manual_seed(step)) * step
        encoded = compressor.encode(gradient, segments)
        assert encoded.nbytes < 0.05 * encoded.dense_bytes  # 5% kept in about 3.5 of 4 bytes each
        start = state.parameters()
        assert push(client, plan, state, encoded.data, step).outcome == pb.PushReply.APPLIED
        decoded = torch.empty(plan.numel)
        compressor.decode(encoded.data, segments, decoded)
        assert torch.equal(state.parameters(), start - LEARNING_RATE * decoded)


# how an honest payload is broken, and words of the refusal (one sparse block: kind, count,
# index bytes, varints, fp16 values)
MALFORMED = {
    "kind": (lambda d: b"\x05" + d[1:], "neither dense"),
    "count": (lambda d: d[:1] + struct.pack("<I", 0) + d[5:], "count 0"),
    "index bytes": (lambda d: d[:5] + struct.pack("<I", 10 ** 6) + d[9:], "cannot hold"),
    "varints": (lambda d: d[:9] + b"\xff\xff\xff\x7f" + d[13:], "varints, expected"),
    "NaN value": (lambda d: d[:-2] + struct.pack("<e", float("nan")), "NaN or infinite"),
    "truncated": (lambda d: d[:-3], "needs"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_compact_push_is_refused_and_changes_nothing(shard, case):
    state, plan, client, compressor = shard
    breaks, words = MALFORMED[case]
    if case == "truncated" and client.shards[0].segments is not None:
        pytest.skip("through shared memory the server reads as many bytes as a payload can take: "
                    "the segment holds the rest of the earlier push")
    honest = compressor.encode(torch.randn(plan.numel, generator=torch.Generator().manual_seed(1)),
                               shard_segments(plan)).data
    assert push(client, plan, state, honest, 1).outcome == pb.PushReply.APPLIED
    version, params = state.version, state.parameters()
    with pytest.raises(DistributedError) as raised:
        push(client, plan, state, breaks(honest), 2)
    assert "INVALID_ARGUMENT" in str(raised.value) and words in str(raised.value), str(raised.value)
    assert state.version == version and torch.equal(state.parameters(), params)
    assert state.status()["num_invalid"] == 1
    assert push(client, plan, state, honest, 2).outcome == pb.PushReply.APPLIED
