"""The parameter-server service on the wire: method paths, (de)serializers, channel options.

Gradients and parameters use the hand framing of `codec` (valid protobuf, one copy out,
zero copies in); every other method uses the generated protobuf classes. Server and
client both build their method tables from here, so they cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from disttrain.proto import parameter_server_pb2 as pb
from disttrain.proto import tensor_pb2
from disttrain.strategies.ps.wire.codec import (
    CHUNK_BYTES,
    Frame,
    Payload,
    decode_frame,
    decode_tensor,
    encode_frames,
    encode_frames_from_end,
    tensor_bytes,
)
from disttrain.strategies.ps.wire.sharding import ShardPlan, TensorSlice

SERVICE = "disttrain.v1.ParameterServerService"
GRADIENT_PAYLOAD_FIELD = pb.GradientMessage.DESCRIPTOR.fields_by_name["payload"].number
PARAMETER_PAYLOAD_FIELD = pb.ParameterMessage.DESCRIPTOR.fields_by_name["payload"].number
MAX_MESSAGE_BYTES = 64 << 20

# Chunks of about 1 MB keep every message far below the size limits and let both ends
# pipeline; the window options keep a stream's bytes flowing without waiting for acks.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", 64 << 20),
    ("grpc.http2.bdp_probe", 0),
    # Reconnect to a restarted server within about a second, not gRPC's default of up to
    # two minutes of backoff after a few failed attempts.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# Payloads up to this size travel in one message of a unary call (PushGradients,
# FetchParameters): on loopback a streaming call costs several times a unary one's
# latency, and one message of a few MB still moves at a stream's bandwidth. Larger
# payloads are streamed in CHUNK_BYTES pieces (one message of tens of MB crawls).
UNARY_MAX_BYTES = 4 << 20

# method -> (kind, request type or None for framed, response type or None for framed)
METHODS = {
    "SendGradients": ("stream_unary", None, pb.PushReply),
    "GetParameters": ("unary_stream", pb.ParameterRequest, None),
    "PushGradients": ("unary_unary", None, pb.PushReply),
    "FetchParameters": ("unary_unary", pb.ParameterRequest, None),
    "Step": ("stream_stream", None, None),
    "RegisterWorker": ("unary_unary", pb.RegisterRequest, pb.WorkerAssignment),
    "WorkerDone": ("unary_unary", pb.WorkerDoneRequest, pb.ShardStatus),
    "GetStatus": ("unary_unary", pb.StatusRequest, pb.ShardStatus),
    "Shutdown": ("unary_unary", pb.ShutdownRequest, pb.ShardStatus),
    "Barrier": ("unary_unary", pb.BarrierRequest, pb.BarrierReply),
    "GetLedger": ("unary_unary", pb.LedgerRequest, pb.LedgerReply),
}

# The most bytes a request of each unframed kind may take: what it can legitimately carry
# (ids, a session, a key, a hostname; a barrier's few values) with ample room. A larger
# one is refused before it is parsed, whatever the channel's message limit.
REQUEST_MAX_BYTES = {
    "GetParameters": 4 << 10,
    "FetchParameters": 4 << 10,
    "RegisterWorker": 16 << 10,
    "WorkerDone": 4 << 10,
    "GetStatus": 4 << 10,
    "Shutdown": 1 << 10,
    "Barrier": 16 << 10,
    "GetLedger": 4 << 10,
}


@dataclass
class Snapshot:
    """A shard's parameters at `version` as ready-made wire messages (immutable; every
    reader of that version streams the same ones, so they are built once per version)."""

    version: int
    frames: list[bytes]
    # Pull compression: the changes to `version` from the version a worker holds (the
    # key), for each such version asked for yet; filled by the shard, under its lock.
    changes: dict[int, list[bytes]] = field(default_factory=dict)


def method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


def identity(data: bytes) -> bytes:
    return data


def read_gradient(raw: bytes, max_fields: int | None = None) -> Frame:
    return decode_frame(raw, pb.GradientMessage, GRADIENT_PAYLOAD_FIELD, tensor_pb2.TensorProto,
                        max_fields)


def read_parameters(raw: bytes) -> Frame:
    return decode_frame(raw, pb.ParameterMessage, PARAMETER_PAYLOAD_FIELD, tensor_pb2.TensorProto)


def slice_specs(plan: ShardPlan) -> list[tensor_pb2.SliceSpec]:
    return [tensor_pb2.SliceSpec(name=s.name, shape=s.shape, start=s.start, length=s.length)
            for s in plan.slices]


def plan_layout(specs) -> tuple[TensorSlice, ...]:
    return tuple(TensorSlice(s.name, tuple(s.shape), s.start, s.length) for s in specs)


def fits_one_message(nbytes: int) -> bool:
    """Whether a payload of `nbytes` travels in one message of a unary call."""
    return nbytes <= UNARY_MAX_BYTES


def _chunk_bytes(nbytes: int) -> int:
    return max(nbytes, 1) if fits_one_message(nbytes) else CHUNK_BYTES


def gradient_frames(header: pb.GradientMessage, plan: ShardPlan, data: memoryview) -> Iterator[bytes]:
    """The wire messages of one push: `header` (layout and payload left unset) + `data`,
    in one message when it fits one, else in `CHUNK_BYTES` pieces."""
    header.layout.extend(slice_specs(plan))
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype=plan.dtype)
    data = memoryview(data)
    return encode_frames(header, GRADIENT_PAYLOAD_FIELD, meta, data, _chunk_bytes(data.nbytes))


def gradient_frames_from_end(header: pb.GradientMessage, plan: ShardPlan, data: memoryview,
                             ready: Callable[[int], bool]) -> Iterator[bytes]:
    """The wire messages of one push streamed while its bytes are still being written:
    `CHUNK_BYTES` pieces last first (`codec.encode_frames_from_end`, `header.from_end`
    set), each read once `ready(start)` returns True (False: no more frames)."""
    header.layout.extend(slice_specs(plan))
    header.from_end = True
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype=plan.dtype)
    return encode_frames_from_end(header, GRADIENT_PAYLOAD_FIELD, meta, data, CHUNK_BYTES, ready)


@dataclass(frozen=True)
class ParameterStamp:
    """What a pull answer says of the parameters it carries, beside their bytes.

    Attributes:
        version: the shard's version they are at.
        incarnation: the shard's (tells a worker the shard restarted).
        buffers: the shard's buffers (`buffer_proto`; None: it holds none).
        sync_step: the run's step the parameters are the result of (sync mode).
        restored: the shard came back from a checkpoint and has applied no step since.
    """

    version: int
    incarnation: int = 0
    buffers: tensor_pb2.TensorProto | None = None
    sync_step: int = 0
    restored: bool = False


def parameter_frames(plan: ShardPlan, stamp: ParameterStamp, data: memoryview,
                     compression_type: str = "") -> Iterator[bytes]:
    """The wire messages of one pull answer, cut like a push's; the `stamp` (the shard's
    buffers included) rides in the first. With `compression_type`, `data` is pull
    compression's change from version - 1 (`payloads.ParameterChanges`)."""
    chunk_bytes = _chunk_bytes(memoryview(data).nbytes if compression_type else plan.nbytes)
    header = pb.ParameterMessage(version=stamp.version, shard=plan.shard, layout=slice_specs(plan),
                                 incarnation=stamp.incarnation, buffers=stamp.buffers,
                                 sync_step=stamp.sync_step, restored=stamp.restored,
                                 compressed=bool(compression_type), compression_type=compression_type)
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype=plan.dtype)
    return encode_frames(header, PARAMETER_PAYLOAD_FIELD, meta, data, chunk_bytes)


def parameter_notice(plan: ShardPlan, stamp: ParameterStamp) -> bytes:
    """The one message of a pull answered through shared memory: no payload bytes (the
    stamp, the shard's buffers small, still travels in it)."""
    meta = tensor_pb2.TensorProto(shape=[plan.numel], dtype=plan.dtype)
    return pb.ParameterMessage(version=stamp.version, shard=plan.shard, payload=meta, shared_memory=True,
                               incarnation=stamp.incarnation, buffers=stamp.buffers,
                               sync_step=stamp.sync_step, restored=stamp.restored).SerializeToString()


def step_answer(push: pb.PushReply, parameters: bytes = b"") -> bytes:
    """A reply of Step: `parameters` (one ParameterMessage, or none) with the push's
    outcome added. Two serialized messages of one type concatenated are one message with
    the fields of both, so the ready-made parameter frame is reused as it is."""
    return pb.ParameterMessage(push=push).SerializeToString() + parameters


# A shard's model buffers travel inline, in the header of every push (the change the
# worker's step made to them) and of every parameter answer (their values at its
# version): they are small next to the parameters, and float64 holds every buffer dtype
# the plan keeps exactly (integers up to 2**53), so one raw tensor carries them all.
BUFFER_DTYPE = "float64"


def buffer_proto(values: torch.Tensor) -> tensor_pb2.TensorProto:
    """The wire form of a shard's flat buffer values (or changes): float64, 1-D."""
    values = values.detach().reshape(-1).to(torch.float64)
    return tensor_pb2.TensorProto(data=bytes(tensor_bytes(values)), shape=[values.numel()],
                                  dtype=BUFFER_DTYPE)


def read_buffers(message, plan: ShardPlan, what: str) -> torch.Tensor | None:
    """The flat float64 buffers a message (GradientMessage or ParameterMessage) carries
    for `plan` (a copy), or None when the shard holds no buffers.

    Args:
        what: how to name the message in errors ("push", "answer of shard 1").
    Raises:
        ValueError: buffers missing where the shard holds some, present where it holds
            none, or not of the plan's length, dtype or finite values.
    """
    present = message.HasField("buffers")
    if not plan.buffers:
        if present:
            raise ValueError(f"{what} carries buffers, but shard {plan.shard} holds none; start servers "
                             "and workers with the same model")
        return None
    if not present:
        raise ValueError(f"{what} carries no buffers, but shard {plan.shard} holds "
                         f"{len(plan.buffers)} ({', '.join(b.name for b in plan.buffers)})")
    proto = message.buffers
    if proto.dtype != BUFFER_DTYPE or list(proto.shape) != [plan.buffer_numel]:
        raise ValueError(f"{what}: buffers are {proto.dtype or 'unset'} {list(proto.shape)}, expected "
                         f"{BUFFER_DTYPE} [{plan.buffer_numel}]")
    values = decode_tensor(proto.data, BUFFER_DTYPE, (plan.buffer_numel,)).clone()
    if values.numel() and not math.isfinite(float(values.abs().max())):
        raise ValueError(f"{what}: buffers hold NaN or infinite values")
    return values


def collect_payload(frames: Iterator[Frame], max_bytes: int, max_frames: int | None = None,
                    require_data: bool = False) -> Payload:
    """Gather a chunked stream into one payload, without copying its bytes. Stops reading
    at the first frame over a bound.

    Args:
        max_bytes: the most payload bytes the stream may carry.
        max_frames: the most frames it may have (None: no bound).
        require_data: every frame must carry payload bytes (a push's first frame may go
            without when its header says the bytes are in shared memory): frames of no
            bytes would otherwise never bring the stream nearer its byte bound.
    Raises:
        ValueError: an empty stream, a frame without bytes, or more than `max_frames`
            frames or `max_bytes` bytes.
    """
    first = next(frames, None)
    if first is None:
        raise ValueError("empty stream: no message arrived")
    chunks, total = [first.data], first.data.nbytes
    if require_data and not total and not first.header.shared_memory:
        raise ValueError("frame 1 carries no payload bytes; every frame of a push carries some")
    for frame in frames:
        total += frame.data.nbytes
        if total > max_bytes:
            break
        if require_data and not frame.data.nbytes:
            raise ValueError(f"frame {len(chunks) + 1} carries no payload bytes; every frame of a "
                             "push carries some")
        if max_frames is not None and len(chunks) >= max_frames:
            raise ValueError(f"more than {max_frames} frames; this shard's largest push needs fewer")
        chunks.append(frame.data)
    if total > max_bytes:
        raise ValueError(f"payload exceeds the {max_bytes} bytes this shard expects")
    if getattr(first.header, "from_end", False):  # a push streamed last piece first
        chunks.reverse()
    return Payload(first.header, first.meta, chunks)
