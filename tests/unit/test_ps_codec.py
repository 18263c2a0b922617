"""Codec: raw little-endian tensors and hand-framed protobuf messages, both directions."""

import pytest
import torch

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire


@pytest.mark.parametrize("dtype", list(codec.DTYPES.values()))
def test_tensor_round_trip_every_dtype(dtype):
    source = (torch.randn(3, 5) * 50).to(dtype)
    data = codec.tensor_bytes(source)
    assert data.nbytes == source.numel() * source.element_size()
    decoded = codec.decode_tensor(bytes(data), codec.dtype_name(dtype), (3, 5))
    assert decoded.dtype == dtype and torch.equal(decoded, source)


def test_bytes_are_little_endian():
    data = codec.tensor_bytes(torch.tensor([1], dtype=torch.int32))
    assert bytes(data) == b"\x01\x00\x00\x00"


def test_decode_does_not_copy():
    buffer = bytearray(codec.tensor_bytes(torch.arange(4, dtype=torch.float32)))
    decoded = codec.decode_tensor(buffer, "float32")
    buffer[0:4] = codec.tensor_bytes(torch.tensor([7.0]))
    assert decoded[0].item() == 7.0


def test_decode_rejects_lengths_that_do_not_fit():
    with pytest.raises(ValueError, match="whole number"):
        codec.decode_tensor(b"\x00" * 7, "float32")
    with pytest.raises(ValueError, match="needs 24"):
        codec.decode_tensor(b"\x00" * 20, "float32", (2, 3))
    with pytest.raises(ValueError, match="unknown dtype"):
        codec.decode_tensor(b"", "complex64")


@pytest.mark.parametrize("numel", [0, 10, 300_000, 700_000])
def test_frames_are_valid_protobuf_and_decode_back(numel):
    values = torch.randn(numel)
    header = pb.GradientMessage(worker_id="w", step=3, base_version=7, shard=1, num_samples=64)
    meta = tensor_pb2.TensorProto(shape=[numel], dtype="float32")
    frames = list(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta, codec.tensor_bytes(values)))
    assert len(frames) == max(1, -(-numel * 4 // codec.CHUNK_BYTES))
    assert all(len(f) <= codec.CHUNK_BYTES + 128 for f in frames)
    parsed = [pb.GradientMessage.FromString(f) for f in frames]  # the stock parser agrees
    assert parsed[0].step == 3 and parsed[0].base_version == 7 and list(parsed[0].payload.shape) == [numel]
    assert b"".join(p.payload.data for p in parsed) == bytes(codec.tensor_bytes(values))
    payload = wire.collect_payload(iter(wire.read_gradient(f) for f in frames), numel * 4)
    assert payload.header.worker_id == "w" and payload.meta.dtype == "float32" and payload.nbytes == numel * 4
    out = torch.empty(numel)
    codec.copy_chunks(codec.decode_chunks(payload.chunks, "float32"), out)
    assert torch.equal(out, values)


def test_stock_serialized_messages_decode_too():
    message = pb.ParameterMessage(version=5, payload=tensor_pb2.TensorProto(data=b"abcd", dtype="int8",
                                                                           shape=[4]))
    frame = wire.read_parameters(message.SerializeToString())
    assert frame.header.version == 5 and bytes(frame.data) == b"abcd" and list(frame.meta.shape) == [4]


@pytest.mark.parametrize("raw", [b"\x52\x05abc", b"\x08", b"\x0f\x01", b"\x52\x03\x0a\x09ab"])
def test_malformed_frames_raise_value_error(raw):
    with pytest.raises(ValueError, match="malformed|truncated"):
        wire.read_gradient(raw)


def test_collect_payload_bounds_the_size():
    frames = [codec.Frame(None, None, memoryview(b"x" * 10)) for _ in range(3)]
    with pytest.raises(ValueError, match="exceeds"):
        wire.collect_payload(iter(frames), 25)
    with pytest.raises(ValueError, match="empty stream"):
        wire.collect_payload(iter([]), 25)
