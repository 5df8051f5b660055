from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FLOAT: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_DOUBLE: _ClassVar[DataType]

class ConsistencyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSISTENCY_MODE_UNSPECIFIED: _ClassVar[ConsistencyMode]
    CONSISTENCY_MODE_ASYNC: _ClassVar[ConsistencyMode]
    CONSISTENCY_MODE_SYNC: _ClassVar[ConsistencyMode]

class Reduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCTION_UNSPECIFIED: _ClassVar[Reduction]
    REDUCTION_MEAN: _ClassVar[Reduction]
    REDUCTION_SUM: _ClassVar[Reduction]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FLOAT: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_DOUBLE: DataType
CONSISTENCY_MODE_UNSPECIFIED: ConsistencyMode
CONSISTENCY_MODE_ASYNC: ConsistencyMode
CONSISTENCY_MODE_SYNC: ConsistencyMode
REDUCTION_UNSPECIFIED: Reduction
REDUCTION_MEAN: Reduction
REDUCTION_SUM: Reduction

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "dims", "raw_data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    RAW_DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DataType
    dims: _containers.RepeatedScalarFieldContainer[int]
    raw_data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., dims: _Optional[_Iterable[int]] = ..., raw_data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Adagrad(_message.Message):
    __slots__ = ("epsilon", "decay_factor", "norm_coefficient")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DECAY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NORM_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    decay_factor: float
    norm_coefficient: float
    def __init__(self, epsilon: _Optional[float] = ..., decay_factor: _Optional[float] = ..., norm_coefficient: _Optional[float] = ...) -> None: ...

class Momentum(_message.Message):
    __slots__ = ("alpha", "beta", "mode", "norm_coefficient")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NORM_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    beta: float
    mode: str
    norm_coefficient: float
    def __init__(self, alpha: _Optional[float] = ..., beta: _Optional[float] = ..., mode: _Optional[str] = ..., norm_coefficient: _Optional[float] = ...) -> None: ...

class Adam(_message.Message):
    __slots__ = ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    NORM_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    NORM_COEFFICIENT_POST_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    beta: float
    epsilon: float
    norm_coefficient: float
    norm_coefficient_post: float
    def __init__(self, alpha: _Optional[float] = ..., beta: _Optional[float] = ..., epsilon: _Optional[float] = ..., norm_coefficient: _Optional[float] = ..., norm_coefficient_post: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("adagrad", "momentum", "adam")
    ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    adagrad: Adagrad
    momentum: Momentum
    adam: Adam
    def __init__(self, adagrad: _Optional[_Union[Adagrad, _Mapping]] = ..., momentum: _Optional[_Union[Momentum, _Mapping]] = ..., adam: _Optional[_Union[Adam, _Mapping]] = ...) -> None: ...

class Consistency(_message.Message):
    __slots__ = ("mode", "sync_workers", "reduction", "max_staleness")
    MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    mode: ConsistencyMode
    sync_workers: int
    reduction: Reduction
    max_staleness: int
    def __init__(self, mode: _Optional[_Union[ConsistencyMode, str]] = ..., sync_workers: _Optional[int] = ..., reduction: _Optional[_Union[Reduction, str]] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "alive", "lease_remaining_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    alive: bool
    lease_remaining_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., alive: _Optional[bool] = ..., lease_remaining_seconds: _Optional[float] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("name", "optimizer", "learning_rate", "update_count", "dtype", "tensors", "consistency", "allow_non_finite", "element_count", "state_bytes", "lease_seconds", "workers", "pending_contributions", "quorum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    optimizer: OptimizerSpec
    learning_rate: float
    update_count: int
    dtype: DataType
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    consistency: Consistency
    allow_non_finite: bool
    element_count: int
    state_bytes: int
    lease_seconds: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    pending_contributions: int
    quorum: int
    def __init__(self, name: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., learning_rate: _Optional[float] = ..., update_count: _Optional[int] = ..., dtype: _Optional[_Union[DataType, str]] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., consistency: _Optional[_Union[Consistency, _Mapping]] = ..., allow_non_finite: _Optional[bool] = ..., element_count: _Optional[int] = ..., state_bytes: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., pending_contributions: _Optional[int] = ..., quorum: _Optional[int] = ...) -> None: ...

class CreateGroupRequest(_message.Message):
    __slots__ = ("group", "optimizer", "learning_rate", "tensors", "consistency", "allow_non_finite", "state", "update_count", "lease_seconds")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    optimizer: OptimizerSpec
    learning_rate: float
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    consistency: Consistency
    allow_non_finite: bool
    state: _containers.RepeatedCompositeFieldContainer[Tensor]
    update_count: int
    lease_seconds: float
    def __init__(self, group: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., learning_rate: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., consistency: _Optional[_Union[Consistency, _Mapping]] = ..., allow_non_finite: _Optional[bool] = ..., state: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., update_count: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class CreateGroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: GroupInfo
    def __init__(self, group: _Optional[_Union[GroupInfo, _Mapping]] = ...) -> None: ...

class CreateGroupStreamRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: CreateGroupRequest
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[CreateGroupRequest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class CreateGroupStreamResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: GroupInfo
    def __init__(self, group: _Optional[_Union[GroupInfo, _Mapping]] = ...) -> None: ...

class DescribeGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class DescribeGroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: GroupInfo
    def __init__(self, group: _Optional[_Union[GroupInfo, _Mapping]] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ...) -> None: ...

class DeleteGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class DeleteGroupResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class SetLearningRateRequest(_message.Message):
    __slots__ = ("group", "learning_rate")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    group: str
    learning_rate: float
    def __init__(self, group: _Optional[str] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class SetLearningRateResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: GroupInfo
    def __init__(self, group: _Optional[_Union[GroupInfo, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("group", "gradients", "client_id", "seq", "base_version", "learning_rate", "return_values")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUES_FIELD_NUMBER: _ClassVar[int]
    group: str
    gradients: _containers.RepeatedCompositeFieldContainer[Tensor]
    client_id: str
    seq: int
    base_version: int
    learning_rate: float
    return_values: bool
    def __init__(self, group: _Optional[str] = ..., gradients: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., base_version: _Optional[int] = ..., learning_rate: _Optional[float] = ..., return_values: _Optional[bool] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("update_count", "applied", "duplicate", "values")
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    update_count: int
    applied: bool
    duplicate: bool
    values: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, update_count: _Optional[int] = ..., applied: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., values: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class PushStreamRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushRequest
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PushRequest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushStreamResponse(_message.Message):
    __slots__ = ("update_count", "applied", "duplicate", "values")
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    update_count: int
    applied: bool
    duplicate: bool
    values: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, update_count: _Optional[int] = ..., applied: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., values: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("group", "with_state", "min_version")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    group: str
    with_state: bool
    min_version: int
    def __init__(self, group: _Optional[str] = ..., with_state: _Optional[bool] = ..., min_version: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("update_count", "tensors", "learning_rate")
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    update_count: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    learning_rate: float
    def __init__(self, update_count: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class PullStreamRequest(_message.Message):
    __slots__ = ("group", "with_state", "min_version")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    group: str
    with_state: bool
    min_version: int
    def __init__(self, group: _Optional[str] = ..., with_state: _Optional[bool] = ..., min_version: _Optional[int] = ...) -> None: ...

class PullStreamResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullResponse
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PullResponse, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("optimizer", "inputs")
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    optimizer: OptimizerSpec
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class ApplyStreamRequest(_message.Message):
    __slots__ = ("request", "chunk")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    request: ApplyRequest
    chunk: TensorChunk
    def __init__(self, request: _Optional[_Union[ApplyRequest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ApplyStreamResponse(_message.Message):
    __slots__ = ("response", "chunk")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    response: ApplyResponse
    chunk: TensorChunk
    def __init__(self, response: _Optional[_Union[ApplyResponse, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("group", "worker_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    worker_id: str
    def __init__(self, group: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class JoinGroupResponse(_message.Message):
    __slots__ = ("lease_seconds", "update_count", "live_workers", "quorum")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    update_count: int
    live_workers: int
    quorum: int
    def __init__(self, lease_seconds: _Optional[float] = ..., update_count: _Optional[int] = ..., live_workers: _Optional[int] = ..., quorum: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("group", "worker_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    worker_id: str
    def __init__(self, group: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds", "update_count", "live_workers", "quorum")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    update_count: int
    live_workers: int
    quorum: int
    def __init__(self, lease_seconds: _Optional[float] = ..., update_count: _Optional[int] = ..., live_workers: _Optional[int] = ..., quorum: _Optional[int] = ...) -> None: ...

class LeaveGroupRequest(_message.Message):
    __slots__ = ("group", "worker_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    worker_id: str
    def __init__(self, group: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class LeaveGroupResponse(_message.Message):
    __slots__ = ("lease_seconds", "update_count", "live_workers", "quorum")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    update_count: int
    live_workers: int
    quorum: int
    def __init__(self, lease_seconds: _Optional[float] = ..., update_count: _Optional[int] = ..., live_workers: _Optional[int] = ..., quorum: _Optional[int] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("path", "groups", "bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    groups: int
    bytes: int
    def __init__(self, path: _Optional[str] = ..., groups: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
