from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HeartbeatMessage(_message.Message):
    __slots__ = ("worker_id", "timestamp", "epoch", "step", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    timestamp: float
    epoch: int
    step: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., timestamp: _Optional[float] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("alive",)
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    alive: bool
    def __init__(self, alive: _Optional[bool] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("worker_id", "step", "epoch", "scalars")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    epoch: int
    scalars: _containers.ScalarMap[str, float]
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ..., scalars: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
