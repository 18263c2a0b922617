"""Tensors <-> wire bytes, without pickle and with as few copies as the transport allows.

A tensor travels as its raw little-endian element bytes and is decoded with
`torch.frombuffer` (no copy). Many tensors travel as one flat buffer. A message whose
payload exceeds `CHUNK_BYTES` is streamed as several protobuf messages: the first holds
every header field and the first chunk of `payload.data`, the rest hold only further
bytes of `payload.data` (see proto/disttrain/v1/tensor.proto).

The hot messages (gradients and parameters) are framed here by hand, in protobuf's own
wire format: the header is serialized by protobuf, the payload bytes are appended as the
`data` field of the payload `TensorProto`, so the bytes go from the tensor's storage
into the frame in one copy, and on arrival `decode_frame` hands them out as a
`memoryview` of the received buffer (no copy). Any protobuf parser reads these frames as
ordinary messages, so the contract is unchanged. This module knows nothing of gRPC.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

CHUNK_BYTES = 1 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_TENSOR_DATA_FIELD = 1
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("float32", ...).

    Raises:
        ValueError: the dtype has no wire name.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot travel on the wire; use one of {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


def to_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name.

    Raises:
        ValueError: unknown name.
    """
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, as a view of its storage when possible."""
    tensor = tensor.detach().contiguous().cpu()
    if not _LITTLE_ENDIAN_HOST and tensor.element_size() > 1:
        tensor = torch.from_numpy(tensor.numpy().byteswap())
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: view the same bytes as int16
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


def check_shape(shape: tuple[int, ...], itemsize: int) -> None:
    """Refuse a shape from the wire that no tensor can take: a negative size, or one whose
    strides (the products of the sizes after each, a size of 0 counted as 1) or bytes
    pass 64 bits; such a shape of 0 elements matches 0 bytes, and torch's view of it fails
    with RuntimeError (found by the codec's fuzz test).

    Raises:
        ValueError: which size, against what.
    """
    if any(size < 0 for size in shape):
        raise ValueError(f"shape {list(shape)} has a negative size")
    if math.prod(max(size, 1) for size in shape) * itemsize >= 2 ** 63:
        raise ValueError(f"shape {list(shape)} is too large for a tensor (strides past 64 bits)")


def decode_tensor(data: Any, dtype: str | torch.dtype, shape: tuple[int, ...] | None = None
                  ) -> torch.Tensor:
    """A tensor over `data` (bytes, bytearray or memoryview of raw little-endian elements).

    The tensor shares memory with `data` and must be treated as read-only when `data` is.

    Raises:
        ValueError: the byte length does not fit the dtype and shape, or the shape is not
            one a tensor can take (a negative size, or strides past 64 bits).
    """
    dtype = to_dtype(dtype) if isinstance(dtype, str) else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    length = memoryview(data).nbytes
    if length % itemsize:
        raise ValueError(f"{length} bytes is not a whole number of {dtype} elements")
    expected = None
    if shape is not None:
        check_shape(shape, itemsize)
        expected = math.prod(shape) * itemsize
    if expected is not None and expected != length:
        raise ValueError(f"{length} bytes given for shape {list(shape)} of {dtype}, which needs {expected}")
    if length == 0:
        flat = torch.empty(0, dtype=dtype)
    else:
        with warnings.catch_warnings():  # read-only buffers: callers copy before writing
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=dtype)
    if not _LITTLE_ENDIAN_HOST and itemsize > 1:
        flat = torch.from_numpy(flat.numpy().byteswap())
    return flat if shape is None else flat.view(shape)


# ----------------------------------------------------------------------------------------
# protobuf wire format, just enough to frame one large bytes field by hand


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated message: a varint runs past the end")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed message: varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """Yield (number, wire_type, field_start, value_start, end) of each top-level field."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _WIRE_VARINT:
            _, end = _read_varint(buf, pos)
        elif wire_type == _WIRE_I64:
            end = pos + 8
        elif wire_type == _WIRE_I32:
            end = pos + 4
        elif wire_type == _WIRE_LEN:
            length, pos = _read_varint(buf, pos)
            end = pos + length
        else:
            raise ValueError(f"malformed message: unsupported wire type {wire_type}")
        if end > len(buf):
            raise ValueError("truncated message: a field runs past the end")
        yield number, wire_type, start, pos, end
        pos = end


def _len_field(number: int, length: int) -> bytes:
    return _varint(number << 3 | _WIRE_LEN) + _varint(length)


@dataclass
class Payload:
    """A whole message gathered from its stream: the first frame's header and payload
    metadata, and the payload bytes as the list of received chunks (not joined: each
    consumer copies them once, straight to where they go)."""

    header: Any
    meta: Any
    chunks: list[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)


def decode_chunks(chunks: list[memoryview], dtype: str | torch.dtype) -> list[torch.Tensor]:
    """One 1-D tensor over each chunk (no copy).

    Raises:
        ValueError: a chunk is not a whole number of elements.
    """
    return [decode_tensor(chunk, dtype) for chunk in chunks]


def copy_chunks(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """Copy consecutive 1-D chunks into the 1-D tensor `out` (their total length)."""
    offset = 0
    for tensor in tensors:
        out[offset:offset + tensor.numel()].copy_(tensor)
        offset += tensor.numel()


@dataclass
class Frame:
    """One received message: its header fields, its payload's metadata, its payload bytes.

    `header` is the message with the payload's `data` left out; `meta` is the payload
    TensorProto without `data`; `data` is a view of the received buffer.
    """

    header: Any
    meta: Any
    data: memoryview


def encode_frames(header: Any, payload_field: int, meta: Any, data: memoryview,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Serialize `header` with the payload `meta` + `data` as one or more wire messages.

    Args:
        header: the message, without its payload field set.
        payload_field: field number of the payload TensorProto in the header's type.
        meta: the payload TensorProto without `data`.
        data: the payload bytes; the first `chunk_bytes` go with the header, the rest in
            further messages of `chunk_bytes` each.
    Yields:
        Serialized messages, each valid for the header's type.
    """
    data = memoryview(data).cast("B")
    yield _first_frame(header, payload_field, meta, data[:chunk_bytes])
    for start in range(chunk_bytes, data.nbytes, chunk_bytes):
        yield _next_frame(payload_field, data[start:start + chunk_bytes])


def pieces_from_end(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of a payload of `total` bytes cut into `chunk_bytes`
    pieces from its end: the last piece first, the first (possibly shorter) last."""
    return [(max(0, end - chunk_bytes), end) for end in range(total, 0, -chunk_bytes)] or [(0, 0)]


def encode_frames_from_end(header: Any, payload_field: int, meta: Any, data: memoryview,
                           chunk_bytes: int = CHUNK_BYTES,
                           ready: Callable[[int], bool] = lambda start: True) -> Iterator[bytes]:
    """`encode_frames` with the pieces last first (`pieces_from_end`): the header rides with
    the payload's last piece. `ready(start)` is called before the piece beginning at byte
    `start` is read: it may wait for those bytes to be written, and stops the frames by
    returning False. The receiver reverses the pieces (the header says `from_end`)."""
    data = memoryview(data).cast("B")
    for k, (start, end) in enumerate(pieces_from_end(data.nbytes, chunk_bytes)):
        if not ready(start):
            return
        piece = data[start:end]
        yield _next_frame(payload_field, piece) if k else _first_frame(header, payload_field, meta, piece)


def _first_frame(header: Any, payload_field: int, meta: Any, piece: memoryview) -> bytes:
    meta_bytes = meta.SerializeToString()
    inner = _len_field(_TENSOR_DATA_FIELD, piece.nbytes)
    payload_len = len(meta_bytes) + len(inner) + piece.nbytes
    return b"".join((header.SerializeToString(), _len_field(payload_field, payload_len), meta_bytes, inner,
                     piece))


def _next_frame(payload_field: int, piece: memoryview) -> bytes:
    inner = _len_field(_TENSOR_DATA_FIELD, piece.nbytes)
    return b"".join((_len_field(payload_field, len(inner) + piece.nbytes), inner, piece))


def decode_frame(raw: bytes, header_type: Any, payload_field: int, meta_type: Any,
                 max_fields: int | None = None) -> Frame:
    """Split a received message into header, payload metadata and a view of the payload bytes.

    Args:
        max_fields: the most fields (top-level and in the payload) the message may have;
            each costs a view and a parsed object, so a message of many tiny fields would
            cost far more memory than its bytes (None: no bound).
    Raises:
        ValueError: the bytes are not a well-formed message of that shape, or have more
            than `max_fields` fields.
    """
    buf = memoryview(raw)
    header_parts, meta_parts = [], []
    data = memoryview(b"")
    count = _counter(max_fields)
    for number, wire_type, start, value_start, end in _fields(buf):
        count()
        if number != payload_field or wire_type != _WIRE_LEN:
            header_parts.append(buf[start:end])
            continue
        inner = buf[value_start:end]
        for sub_number, sub_type, sub_start, sub_value, sub_end in _fields(inner):
            count()
            if sub_number == _TENSOR_DATA_FIELD and sub_type == _WIRE_LEN:
                data = inner[sub_value:sub_end]  # the last occurrence wins, as in protobuf
            else:
                meta_parts.append(inner[sub_start:sub_end])
    try:
        header = header_type.FromString(b"".join(header_parts))
        meta = meta_type.FromString(b"".join(meta_parts))
    except Exception as e:  # protobuf's DecodeError, or any parser error
        raise ValueError(f"malformed message: {e}") from e
    return Frame(header, meta, data)


def _counter(limit: int | None):
    """A function that raises ValueError once it has been called more than `limit` times."""
    seen = [0]

    def count() -> None:
        seen[0] += 1
        if limit is not None and seen[0] > limit:
            raise ValueError(f"message has more than {limit} fields; a well-formed one has far fewer")
    return count
