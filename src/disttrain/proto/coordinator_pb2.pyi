from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Capabilities(_message.Message):
    __slots__ = ("cpus", "memory_bytes", "gpu", "gpu_count")
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    cpus: int
    memory_bytes: int
    gpu: str
    gpu_count: int
    def __init__(self, cpus: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., gpu: _Optional[str] = ..., gpu_count: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "role", "rank", "address", "hostname", "pid", "capabilities")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    rank: int
    address: str
    hostname: str
    pid: int
    capabilities: Capabilities
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class RegisterNodeReply(_message.Message):
    __slots__ = ("generation", "restarts", "heartbeat_interval_s", "heartbeat_timeout_s", "run_finished")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    restarts: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    run_finished: bool
    def __init__(self, generation: _Optional[int] = ..., restarts: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., run_finished: _Optional[bool] = ...) -> None: ...

class HeartbeatMessage(_message.Message):
    __slots__ = ("node_id", "timestamp", "epoch", "step", "role", "throughput", "step_time_s", "pid", "generation", "batch_size", "warmup_speed", "plans")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SPEED_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    timestamp: float
    epoch: int
    step: int
    role: str
    throughput: float
    step_time_s: float
    pid: int
    generation: int
    batch_size: int
    warmup_speed: float
    plans: int
    def __init__(self, node_id: _Optional[str] = ..., timestamp: _Optional[float] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., role: _Optional[str] = ..., throughput: _Optional[float] = ..., step_time_s: _Optional[float] = ..., pid: _Optional[int] = ..., generation: _Optional[int] = ..., batch_size: _Optional[int] = ..., warmup_speed: _Optional[float] = ..., plans: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("alive", "generation")
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    alive: bool
    generation: int
    def __init__(self, alive: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("node_id", "step", "epoch", "scalars")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    epoch: int
    scalars: _containers.ScalarMap[str, float]
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ..., scalars: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExitReport(_message.Message):
    __slots__ = ("node_id", "exit_code", "reason", "pid", "generation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    exit_code: int
    reason: str
    pid: int
    generation: int
    def __init__(self, node_id: _Optional[str] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., pid: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ExitReply(_message.Message):
    __slots__ = ("known", "generation")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    known: bool
    generation: int
    def __init__(self, known: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class MembershipRequest(_message.Message):
    __slots__ = ("after_generation",)
    AFTER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    after_generation: int
    def __init__(self, after_generation: _Optional[int] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("node_id", "role", "rank", "state", "joined_generation", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOINED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    rank: int
    state: str
    joined_generation: int
    address: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., rank: _Optional[int] = ..., state: _Optional[str] = ..., joined_generation: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class Membership(_message.Message):
    __slots__ = ("generation", "members")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, generation: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "role", "rank", "address", "hostname", "pid", "capabilities", "state", "heartbeat_age_s", "restarts", "epoch", "step", "throughput", "step_time_s", "straggler", "batch_size", "warmup_speed", "plans", "metrics", "metrics_step", "joined_generation")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SPEED_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    METRICS_STEP_FIELD_NUMBER: _ClassVar[int]
    JOINED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    rank: int
    address: str
    hostname: str
    pid: int
    capabilities: Capabilities
    state: str
    heartbeat_age_s: float
    restarts: int
    epoch: int
    step: int
    throughput: float
    step_time_s: float
    straggler: bool
    batch_size: int
    warmup_speed: float
    plans: int
    metrics: _containers.ScalarMap[str, float]
    metrics_step: int
    joined_generation: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., state: _Optional[str] = ..., heartbeat_age_s: _Optional[float] = ..., restarts: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., throughput: _Optional[float] = ..., step_time_s: _Optional[float] = ..., straggler: _Optional[bool] = ..., batch_size: _Optional[int] = ..., warmup_speed: _Optional[float] = ..., plans: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., metrics_step: _Optional[int] = ..., joined_generation: _Optional[int] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("time", "node_id", "kind", "detail", "generation")
    TIME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    time: float
    node_id: str
    kind: str
    detail: str
    generation: int
    def __init__(self, time: _Optional[float] = ..., node_id: _Optional[str] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("time", "node_id", "reason", "detect_s", "recover_s", "generation")
    TIME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETECT_S_FIELD_NUMBER: _ClassVar[int]
    RECOVER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    time: float
    node_id: str
    reason: str
    detect_s: float
    recover_s: float
    generation: int
    def __init__(self, time: _Optional[float] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ..., detect_s: _Optional[float] = ..., recover_s: _Optional[float] = ..., generation: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("generation", "nodes", "events", "recoveries", "omitted_nodes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    OMITTED_NODES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    events: _containers.RepeatedCompositeFieldContainer[ClusterEvent]
    recoveries: _containers.RepeatedCompositeFieldContainer[Recovery]
    omitted_nodes: int
    def __init__(self, generation: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[ClusterEvent, _Mapping]]] = ..., recoveries: _Optional[_Iterable[_Union[Recovery, _Mapping]]] = ..., omitted_nodes: _Optional[int] = ...) -> None: ...
