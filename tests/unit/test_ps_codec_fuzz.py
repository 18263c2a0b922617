"""The wire codec under random and mutated bytes: every input decodes to a frame or is
refused with ValueError (which the server turns into INVALID_ARGUMENT); nothing else
escapes, and what was encoded decodes back exactly."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.wire import codec
from disttrain.strategies.ps.wire import service as wire

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_frames(values: list[float], chunk_bytes: int) -> list[bytes]:
    header = pb.GradientMessage(worker_id="w0", step=3, base_version=2, shard=0, num_samples=8, block_id=3)
    meta = tensor_pb2.TensorProto(shape=[len(values)], dtype="float32")
    data = codec.tensor_bytes(torch.tensor(values, dtype=torch.float32))
    return list(codec.encode_frames(header, wire.GRADIENT_PAYLOAD_FIELD, meta, data, chunk_bytes))


def decode_or_refuse(raw: bytes) -> None:
    try:
        frame = wire.read_gradient(raw)
    except ValueError:
        return
    try:
        codec.decode_tensor(frame.data, frame.meta.dtype or "float32",
                            tuple(frame.meta.shape) if frame.meta.shape else None)
    except ValueError:
        pass


floats = st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64)


@FUZZ
@given(floats, st.integers(min_value=4, max_value=64))
def test_what_is_encoded_decodes_back_exactly(values, chunk_bytes):
    raws = valid_frames(values, chunk_bytes)
    frames = [wire.read_gradient(raw) for raw in raws]
    assert frames[0].header.worker_id == "w0" and frames[0].header.step == 3
    assert list(frames[0].meta.shape) == [len(values)] and frames[0].meta.dtype == "float32"
    data = b"".join(bytes(frame.data) for frame in frames)
    assert codec.decode_tensor(data, "float32", (len(values),)).tolist() == \
        torch.tensor(values, dtype=torch.float32).tolist()


@FUZZ
@given(floats, st.integers(min_value=1, max_value=64))
def test_a_push_streamed_from_its_end_is_gathered_back_in_order(values, chunk_bytes):
    """`encode_frames_from_end`: the header rides with the last piece, every piece is read
    once its bytes are ready (in decreasing order of their starts), and the receiver's
    `collect_payload` puts the pieces back in payload order."""
    header = pb.GradientMessage(worker_id="w0", step=3, shard=0, from_end=True)
    meta = tensor_pb2.TensorProto(shape=[len(values)], dtype="float32")
    data = codec.tensor_bytes(torch.tensor(values, dtype=torch.float32))
    asked: list[int] = []
    raws = list(codec.encode_frames_from_end(header, wire.GRADIENT_PAYLOAD_FIELD, meta, data, chunk_bytes,
                                             lambda start: asked.append(start) or True))
    pieces = codec.pieces_from_end(data.nbytes, chunk_bytes)
    assert asked == [start for start, _ in pieces] == sorted(asked, reverse=True) and asked[-1] == 0
    assert len(raws) == len(pieces) and all(end - start <= chunk_bytes for start, end in pieces)
    payload = wire.collect_payload(iter(wire.read_gradient(raw) for raw in raws), data.nbytes)
    assert payload.header.step == 3
    assert b"".join(bytes(chunk) for chunk in payload.chunks) == bytes(data)


def test_frames_from_the_end_stop_where_ready_says_so():
    header = pb.GradientMessage(worker_id="w0", from_end=True)
    meta = tensor_pb2.TensorProto(shape=[16], dtype="float32")
    data = codec.tensor_bytes(torch.arange(16, dtype=torch.float32))
    raws = list(codec.encode_frames_from_end(header, wire.GRADIENT_PAYLOAD_FIELD, meta, data, 16,
                                             lambda start: start >= 32))
    assert len(raws) == 2  # bytes 48-64 and 32-48; the pieces before 32 never go


@FUZZ
@given(st.binary(max_size=512))
@example(b"\x0a\xff\xff\xff\xff\x0f")  # a length running far past the end
@example(b"\xff" * 11)  # a varint longer than 10 bytes
@example(b"\x0b")  # a group start (unsupported wire type)
def test_random_bytes_decode_or_are_refused_with_value_error(raw):
    decode_or_refuse(raw)


def mutations():
    return st.tuples(floats, st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=6),
                     st.integers(min_value=0), st.sampled_from(["flip", "truncate", "insert"]))


def mutate(raw: bytes, edits, cut: int, how: str) -> bytes:
    buf = bytearray(raw)
    if how == "truncate":
        return bytes(buf[:cut % (len(buf) + 1)])
    for position, value in edits:
        if how == "flip":
            buf[position % len(buf)] = value
        else:
            buf.insert(position % (len(buf) + 1), value)
    return bytes(buf)


@FUZZ
@given(mutations())
# Found by the test below on a CI run: an insert makes the shape (0, 1, 1, 26, 7, 102, ...)
# of 0 bytes, whose strides overflowed torch's view (RuntimeError).
@example(([1.0], [(15, 0), (72263, 20)], 0, "insert"))
def test_mutated_frames_decode_or_are_refused_with_value_error(case):
    values, edits, cut, how = case
    decode_or_refuse(mutate(valid_frames(values, 32)[0], edits, cut, how))


@pytest.mark.slow
@MANY
@given(mutations(), st.binary(max_size=2048))
def test_thousands_of_mutated_and_random_frames(case, raw):
    values, edits, cut, how = case
    decode_or_refuse(mutate(valid_frames(values, 32)[0], edits, cut, how))
    decode_or_refuse(raw)


@pytest.mark.parametrize("shape", [(0, 2 ** 40, 2 ** 40), (-1, -4), (-2, 0), (2 ** 62, 2)])
def test_a_shape_no_tensor_can_take_is_refused_with_value_error(shape):
    with pytest.raises(ValueError, match="shape"):
        codec.decode_tensor(b"" if 0 in shape else bytes(16), "float32", shape)
