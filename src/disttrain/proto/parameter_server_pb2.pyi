from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GradientMessage(_message.Message):
    __slots__ = ("worker_id", "step", "compressed", "compression_type", "base_version", "block_id", "shard", "num_samples", "layout", "payload", "shared_memory", "generation", "epoch", "last_in_epoch", "redo", "incarnation", "session", "buffers", "holds_version", "sync_step", "stand_in", "from_end")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_TYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_IN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REDO_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    HOLDS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    STAND_IN_FIELD_NUMBER: _ClassVar[int]
    FROM_END_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    compressed: bool
    compression_type: str
    base_version: int
    block_id: int
    shard: int
    num_samples: int
    layout: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.SliceSpec]
    payload: _tensor_pb2.TensorProto
    shared_memory: bool
    generation: int
    epoch: int
    last_in_epoch: bool
    redo: bool
    incarnation: int
    session: bytes
    buffers: _tensor_pb2.TensorProto
    holds_version: int
    sync_step: int
    stand_in: bool
    from_end: bool
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., compressed: _Optional[bool] = ..., compression_type: _Optional[str] = ..., base_version: _Optional[int] = ..., block_id: _Optional[int] = ..., shard: _Optional[int] = ..., num_samples: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[_tensor_pb2.SliceSpec, _Mapping]]] = ..., payload: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., shared_memory: _Optional[bool] = ..., generation: _Optional[int] = ..., epoch: _Optional[int] = ..., last_in_epoch: _Optional[bool] = ..., redo: _Optional[bool] = ..., incarnation: _Optional[int] = ..., session: _Optional[bytes] = ..., buffers: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., holds_version: _Optional[int] = ..., sync_step: _Optional[int] = ..., stand_in: _Optional[bool] = ..., from_end: _Optional[bool] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "version", "staleness", "incarnation", "learning_rate")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        APPLIED: _ClassVar[PushReply.Outcome]
        BUFFERED: _ClassVar[PushReply.Outcome]
        STALE: _ClassVar[PushReply.Outcome]
        LATE: _ClassVar[PushReply.Outcome]
        DUPLICATE: _ClassVar[PushReply.Outcome]
        ROLLED_BACK: _ClassVar[PushReply.Outcome]
    APPLIED: PushReply.Outcome
    BUFFERED: PushReply.Outcome
    STALE: PushReply.Outcome
    LATE: PushReply.Outcome
    DUPLICATE: PushReply.Outcome
    ROLLED_BACK: PushReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    outcome: PushReply.Outcome
    version: int
    staleness: int
    incarnation: int
    learning_rate: float
    def __init__(self, outcome: _Optional[_Union[PushReply.Outcome, str]] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., incarnation: _Optional[int] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class ParameterRequest(_message.Message):
    __slots__ = ("worker_id", "min_version", "shard", "shared_memory", "incarnation", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    min_version: int
    shard: int
    shared_memory: bool
    incarnation: int
    session: bytes
    def __init__(self, worker_id: _Optional[str] = ..., min_version: _Optional[int] = ..., shard: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., incarnation: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class ParameterMessage(_message.Message):
    __slots__ = ("version", "shard", "layout", "payload", "compressed", "compression_type", "shared_memory", "incarnation", "push", "buffers", "sync_step", "restored")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    version: int
    shard: int
    layout: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.SliceSpec]
    payload: _tensor_pb2.TensorProto
    compressed: bool
    compression_type: str
    shared_memory: bool
    incarnation: int
    push: PushReply
    buffers: _tensor_pb2.TensorProto
    sync_step: int
    restored: bool
    def __init__(self, version: _Optional[int] = ..., shard: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[_tensor_pb2.SliceSpec, _Mapping]]] = ..., payload: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., compressed: _Optional[bool] = ..., compression_type: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., incarnation: _Optional[int] = ..., push: _Optional[_Union[PushReply, _Mapping]] = ..., buffers: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., sync_step: _Optional[int] = ..., restored: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "requested_rank", "hostname", "pid", "shared_memory", "generation", "key", "epochs_done", "sync_step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_RANK_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_DONE_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    requested_rank: int
    hostname: str
    pid: int
    shared_memory: bool
    generation: int
    key: bytes
    epochs_done: int
    sync_step: int
    def __init__(self, worker_id: _Optional[str] = ..., requested_rank: _Optional[int] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., generation: _Optional[int] = ..., key: _Optional[bytes] = ..., epochs_done: _Optional[int] = ..., sync_step: _Optional[int] = ...) -> None: ...

class SharedMemoryOffer(_message.Message):
    __slots__ = ("gradient_path", "parameter_path", "nonce")
    GRADIENT_PATH_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_PATH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    gradient_path: str
    parameter_path: str
    nonce: bytes
    def __init__(self, gradient_path: _Optional[str] = ..., parameter_path: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class WorkerAssignment(_message.Message):
    __slots__ = ("rank", "world_size", "worker_id", "shard", "num_shards", "aggregation_mode", "staleness", "version", "layout", "dtype", "shared_memory", "incarnation", "session")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    worker_id: str
    shard: int
    num_shards: int
    aggregation_mode: str
    staleness: int
    version: int
    layout: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.SliceSpec]
    dtype: str
    shared_memory: SharedMemoryOffer
    incarnation: int
    session: bytes
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., worker_id: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., aggregation_mode: _Optional[str] = ..., staleness: _Optional[int] = ..., version: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[_tensor_pb2.SliceSpec, _Mapping]]] = ..., dtype: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemoryOffer, _Mapping]] = ..., incarnation: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class WorkerDoneRequest(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: bytes
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("wait_all_done", "worker_id", "session")
    WAIT_ALL_DONE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    wait_all_done: bool
    worker_id: str
    session: bytes
    def __init__(self, wait_all_done: _Optional[bool] = ..., worker_id: _Optional[str] = ..., session: _Optional[bytes] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: bytes
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[bytes] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("worker_id", "name", "values", "session", "step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    values: _containers.RepeatedScalarFieldContainer[float]
    session: bytes
    step: int
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ..., session: _Optional[bytes] = ..., step: _Optional[int] = ...) -> None: ...

class BarrierReply(_message.Message):
    __slots__ = ("world_size", "values", "given_up")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GIVEN_UP_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    values: _containers.RepeatedScalarFieldContainer[float]
    given_up: bool
    def __init__(self, world_size: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ..., given_up: _Optional[bool] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard", "num_shards", "version", "world_size", "num_registered", "num_done", "num_applied", "num_rejected_stale", "num_dropped_late", "num_duplicates", "num_invalid", "staleness_histogram", "round_wait_s", "aggregation_mode", "num_samples_applied", "num_samples_duplicate", "num_blocks_applied", "num_fenced", "incarnation", "generation", "max_round_wait_s", "num_refused_nonfinite")
    class StalenessHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    NUM_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_APPLIED_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_STALE_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_LATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NUM_INVALID_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    ROUND_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUND_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    version: int
    world_size: int
    num_registered: int
    num_done: int
    num_applied: int
    num_rejected_stale: int
    num_dropped_late: int
    num_duplicates: int
    num_invalid: int
    staleness_histogram: _containers.ScalarMap[int, int]
    round_wait_s: float
    aggregation_mode: str
    num_samples_applied: int
    num_samples_duplicate: int
    num_blocks_applied: int
    num_fenced: int
    incarnation: int
    generation: int
    max_round_wait_s: float
    num_refused_nonfinite: int
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., version: _Optional[int] = ..., world_size: _Optional[int] = ..., num_registered: _Optional[int] = ..., num_done: _Optional[int] = ..., num_applied: _Optional[int] = ..., num_rejected_stale: _Optional[int] = ..., num_dropped_late: _Optional[int] = ..., num_duplicates: _Optional[int] = ..., num_invalid: _Optional[int] = ..., staleness_histogram: _Optional[_Mapping[int, int]] = ..., round_wait_s: _Optional[float] = ..., aggregation_mode: _Optional[str] = ..., num_samples_applied: _Optional[int] = ..., num_samples_duplicate: _Optional[int] = ..., num_blocks_applied: _Optional[int] = ..., num_fenced: _Optional[int] = ..., incarnation: _Optional[int] = ..., generation: _Optional[int] = ..., max_round_wait_s: _Optional[float] = ..., num_refused_nonfinite: _Optional[int] = ...) -> None: ...

class LedgerRequest(_message.Message):
    __slots__ = ("first_block", "end_block", "worker_id", "session")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    end_block: int
    worker_id: str
    session: bytes
    def __init__(self, first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., worker_id: _Optional[str] = ..., session: _Optional[bytes] = ...) -> None: ...

class LedgerReply(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...
