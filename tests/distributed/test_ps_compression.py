"""Compressed pushes to a shard server on a real socket (port 0), over gRPC bytes and
over shared memory: the server applies exactly the gradient the payload decodes to, and
refuses a malformed payload with INVALID_ARGUMENT, leaving parameters, version and
optimizer state as they were."""

from __future__ import annotations

import struct

import pytest
import torch

from disttrain.compression import Compressor, topk_count
from disttrain.config import config_from_dict
from disttrain.core.errors import DistributedError
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.run.server import build_state
from disttrain.strategies.ps.server.servicer import ShardServer
from disttrain.strategies.ps.wire import shared_memory
from disttrain.strategies.ps.wire.payloads import GradientEncoder, shard_segments
from disttrain.strategies.ps.wire.sharding import plan_shards
from disttrain.strategies.ps.worker.client import PSClient, RetryPolicy
from disttrain.training.models import init_model

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
LEARNING_RATE = 0.5
TRANSPORTS = ["grpc"] + (["shared_memory"] if shared_memory.available() else [])


def make_config(tmp_path, scheme: str | None, ratio: float = 0.05):
    compression = {"enabled": scheme is not None, "type": scheme or "quantization", "ratio": ratio}
    return config_from_dict({
        "training": {"dataset": "digits", "model_architecture": "mlp", "optimizer": "sgd",
                     "momentum": 0.9, "learning_rate": LEARNING_RATE, "checkpoint_interval": 1000},
        "system": {"num_workers": 1, "checkpoint_dir": str(tmp_path / "ckpt")},
        "compression": compression})


class Shard:
    """A running shard server and one registered worker's client."""

    def __init__(self, tmp_path, scheme: str | None, transport: str = "grpc", ratio: float = 0.05):
        self.config = make_config(tmp_path, scheme, ratio)
        self.state = build_state(self.config, 0, 1)
        self.server = ShardServer(self.state, "127.0.0.1:0")
        self.plan = plan_shards(init_model(self.config.training), 1)[0]
        self.client = PSClient([self.server.address], [self.plan],
                               RetryPolicy(timeout_s=10.0, max_attempts=1), transport)
        self.client.register("w0")

    def push(self, data: bytes, step: int, scheme: str | None) -> pb.PushReply:
        header = pb.GradientMessage(worker_id="w0", step=step, base_version=self.state.version,
                                    shard=0, num_samples=8, block_id=step, compressed=scheme is not None,
                                    compression_type=scheme or "")
        reply, _ = self.client.shards[0].push(header, self.plan, memoryview(data))
        return reply

    def snapshot(self):
        optimizer = {k: v["momentum_buffer"].clone() for k, v in self.state.optimizer.state.items()}
        return self.state.version, self.state.parameters(), optimizer

    def close(self):
        self.client.close()
        self.server.stop(0)


@pytest.fixture
def shard_factory(tmp_path):
    made = []

    def make(*args, **kwargs):
        made.append(Shard(tmp_path / str(len(made)), *args, **kwargs))
        return made[-1]

    yield make
    for shard in made:
        shard.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scheme", ["quantization", "topk", "fp16", "bf16"])
def test_the_server_applies_exactly_the_decoded_gradient(shard_factory, scheme, transport):
    shard = shard_factory(scheme, transport)
    encoder = GradientEncoder(Compressor(scheme, ratio=0.05), [shard.plan])
    gradient = torch.randn(shard.plan.numel, generator=torch.Generator().manual_seed(0))
    start = shard.state.parameters()
    (payload,) = encoder.encode(gradient, [0])
    assert payload.nbytes < payload.dense_bytes
    headers = [pb.GradientMessage(worker_id="w0", step=1, base_version=0, shard=0, num_samples=8,
                                  compressed=True, compression_type=scheme)]
    (reply,) = shard.client.push(headers, gradient, [0], [payload])
    assert (reply.outcome, reply.version) == (pb.PushReply.APPLIED, 1)
    decoded = torch.empty(shard.plan.numel)
    Compressor(scheme, ratio=0.05).decode(payload.data, shard_segments(shard.plan), decoded)
    # SGD's first step with momentum: the update is the learning rate times the gradient.
    expected = start - LEARNING_RATE * decoded
    assert torch.equal(shard.state.parameters(), expected)
    assert shard.client.bytes_sent == payload.nbytes


def corrupt(data: bytes, offset: int, packed: bytes) -> bytes:
    return data[:offset] + packed + data[offset + len(packed):]


def honest(shard: Shard, scheme: str) -> bytes:
    gradient = torch.randn(shard.plan.numel, generator=torch.Generator().manual_seed(1))
    return Compressor(scheme, ratio=0.05).encode(gradient, shard_segments(shard.plan)).data


# (scheme the worker claims, how its payload is broken, words of the refusal)
MALFORMED = {
    "index out of range": ("topk", lambda d, n: corrupt(d, 4 * topk_count(n, 0.05), struct.pack("<i", n + 5)),
                           "outside"),
    "indices unsorted": ("topk", lambda d, n: corrupt(d, 4, struct.pack("<ii", 9, 3)), "ascending"),
    "count not k": ("topk", lambda d, n: corrupt(d, 0, struct.pack("<I", 7)), "count is 7"),
    "length": ("topk", lambda d, n: d[:-3], "bytes, expected"),
    "NaN scale": ("quantization", lambda d, n: corrupt(d, 4, struct.pack("<f", float("nan"))),
                  "must be finite"),
    "NaN minimum": ("quantization", lambda d, n: corrupt(d, 0, struct.pack("<f", float("nan"))),
                    "must be finite"),
    "another scheme": ("fp16", lambda d, n: d, "this run uses 'topk'"),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_compressed_push_is_refused_and_changes_nothing(shard_factory, case, transport):
    scheme, breaks, words = MALFORMED[case]
    if case == "length" and transport == "shared_memory":
        pytest.skip("through shared memory the server reads the payload's length from the scheme")
    server_scheme = "topk" if case == "another scheme" else scheme
    shard = shard_factory(server_scheme, transport)
    assert shard.push(honest(shard, server_scheme), 1, server_scheme).outcome == pb.PushReply.APPLIED
    version, params, optimizer = shard.snapshot()
    with pytest.raises(DistributedError) as raised:  # top-k blocks span the shard; int8's, one tensor
        shard.push(breaks(honest(shard, server_scheme), shard.plan.numel), 2, scheme)
    assert "INVALID_ARGUMENT" in str(raised.value) and words in str(raised.value)
    after_version, after_params, after_optimizer = shard.snapshot()
    assert after_version == version and torch.equal(after_params, params)
    assert all(torch.equal(after_optimizer[k], optimizer[k]) for k in optimizer)
    assert shard.state.status()["num_invalid"] == 1
    # the worker's next well-formed push still goes through
    assert shard.push(honest(shard, server_scheme), 2, server_scheme).outcome == pb.PushReply.APPLIED


def test_a_compressed_push_to_a_run_without_compression_is_refused(shard_factory):
    shard = shard_factory(None)
    gradient = torch.ones(shard.plan.numel)
    data = Compressor("topk", ratio=0.05).encode(gradient, shard_segments(shard.plan)).data
    with pytest.raises(DistributedError, match="INVALID_ARGUMENT.*this run sends raw values"):
        shard.push(data, 1, "topk")
    assert shard.state.version == 0


def test_raw_pushes_are_still_taken_by_a_compressing_run(shard_factory):
    shard = shard_factory("topk")
    start = shard.state.parameters()
    gradient = torch.randn(shard.plan.numel)
    header = pb.GradientMessage(worker_id="w0", step=1, base_version=0, shard=0, num_samples=8)
    (reply,) = shard.client.push([header], gradient, [0])
    assert reply.outcome == pb.PushReply.APPLIED
    torch.testing.assert_close(shard.state.parameters(), start - LEARNING_RATE * gradient, rtol=0, atol=1e-6)
