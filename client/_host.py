"""What the operations written apart from the client core (rows, cluster routing,
export and import) need of it: ``CoreHost`` and ``ClusterHost``, implemented by
``ClientCore``. Those modules are typed against these protocols,
not the core's classes, so none of them imports back up into the core: the client's
modules import each other in one direction only (tests/test_layers.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding
from onnxps.wire.initializers import IdsTable

from ._channel_transport import DataChannelLink
from ._cluster import Layout
from ._grpc_transport import Transport
from ._ops import Deadline, Op
from ._optimizers import Async, OptimizerSpec, Sync
from ._pending import PendingPushes
from ._records import GroupInfo, LeaseInfo, PushResult, RowsPage, SaveInfo
from ._shm_transport import SharedMemoryLink
from ._transport import Transports

__all__ = ["ClusterHost", "CoreHost", "Route", "RunningHost", "Targets"]

Array = np.ndarray[Any, Any]
# (shard, name on it) of each part of a group
Targets = list[tuple[int, str]]
R = TypeVar("R")


class Route(Protocol):
    """The operations whose requests depend on where a group lives."""

    def create(
        self,
        req: pb.CreateGroupRequest,
        names: list[str],
        arrays: list[Array],
        state_arrays: list[Array],
        deadline: Deadline,
        table_arrays: Sequence[Sequence[Array]],
    ) -> Op[GroupInfo]: ...

    def describe(self, name: str, deadline: Deadline) -> Op[GroupInfo]: ...

    def list_groups(self, prefix: str, deadline: Deadline) -> Op[list[GroupInfo]]: ...

    def delete(self, name: str, deadline: Deadline) -> Op[bool]: ...

    def set_learning_rate(
        self, name: str, learning_rate: float, deadline: Deadline
    ) -> Op[GroupInfo]: ...

    def push(
        self,
        req: pb.PushRequest,
        arrays: list[Array],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]: ...

    def pull(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding,
        out: Sequence[Array] | None,
        allow_apart: bool,
    ) -> Op[tuple[int, list[Array]]]: ...

    def save(self, deadline: Deadline) -> Op[SaveInfo]: ...

    def push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        base_version: int | None,
        learning_rate: float | None,
        deadline: Deadline,
        encoding: Encoding,
    ) -> Op[PushResult]: ...

    def pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        state: bool,
        min_version: int | None,
        deadline: Deadline,
    ) -> Op[dict[str, Array]]: ...

    def list_rows(
        self,
        group: str,
        table: str,
        page_token: str,
        page_size: int,
        values: bool,
        state: bool,
        deadline: Deadline,
    ) -> Op[RowsPage]: ...

    def join(
        self, group: str, worker_id: str, deadline: Deadline
    ) -> Op[tuple[Targets, LeaseInfo]]: ...

    def leave(
        self, group: str, worker_id: str, deadline: Deadline
    ) -> Op[LeaseInfo]: ...


class CoreHost(Protocol):
    _route: Route
    address: str
    addresses: list[str]
    client_id: str
    shards: int | None
    timeout: float
    gradient_encoding: Encoding
    pull_encoding: Encoding

    _seq: itertools.count[int]
    _sizes: dict[str, int]
    _dtypes: dict[str, np.dtype[Any]]

    def _deadline(self, timeout: float | None) -> Deadline: ...

    def _encoding(self, value: Any, default: Encoding, what: str) -> Encoding: ...

    def _chunks(
        self, message: Any, header: Any, arrays: list[Any]
    ) -> Callable[[], Iterator[Any]]: ...

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]: ...

    def _list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> Op[list[GroupInfo]]: ...

    def _delete_group(self, name: str, *, timeout: float | None = None) -> Op[bool]: ...

    def _create_group(
        self,
        name: str,
        optimizer: OptimizerSpec,
        *,
        learning_rate: float,
        tensors: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        consistency: Async | Sync | None = None,
        allow_non_finite: bool = False,
        state: Sequence[Any] | None = None,
        update_count: int = 0,
        lease_seconds: float | None = None,
        tables: Mapping[str, IdsTable] | None = None,
        table_rows: Sequence[Sequence[Any]] | None = None,
        timeout: float | None = None,
    ) -> Op[GroupInfo]: ...

    def _pull_versioned(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
        out: Sequence[Array] | None = None,
        allow_parts_apart: bool = False,
    ) -> Op[tuple[int, list[Array]]]: ...

    def _export_rows(
        self,
        group: str,
        table: str,
        *,
        state: bool = False,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> Op[tuple[Array, dict[str, Array]]]: ...


class ClusterHost(CoreHost, Protocol):
    """A client of a cluster: what the routing operations (``_sharded``,
    ``_rowsplit``, ``_ids_cluster``) use to send each part to its shard."""

    split_bytes: int
    _layouts: dict[str, Layout]
    _pending: PendingPushes
    _shm_link: SharedMemoryLink
    _data_link: DataChannelLink
    _transports: Transports
    transport: Transport
    stream_threshold_bytes: int
    chunk_bytes: int

    def _remember(self, info: GroupInfo) -> GroupInfo: ...

    def _describe(self, name: str, deadline: Deadline) -> Op[GroupInfo]: ...

    def _create_op(
        self,
        template: pb.CreateGroupRequest,
        names: Sequence[str],
        arrays: Sequence[Array],
        state_arrays: Sequence[Array],
        deadline: Deadline,
        *,
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> Op[pb.GroupInfo]: ...

    def _push_part_op(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Array],
        deadline: Deadline,
        shard: int,
    ) -> Op[PushResult]: ...

    def _pull_op(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding = "native",
        out: Sequence[Array] | None = None,
        shard: int = 0,
    ) -> Op[tuple[int, list[Array]]]: ...

    def _rows_push_op(
        self,
        group: str,
        part: str,
        gradients: Mapping[str, Any],
        base_version: int | None,
        learning_rate: float | None,
        deadline: Deadline,
        encoding: Encoding = "native",
    ) -> Op[PushResult]: ...

    def _rows_send_op(
        self,
        group: str,
        header: pb.PushRowsHeader,
        arrays: list[Array],
        deadline: Deadline,
    ) -> Op[Any]: ...

    def _rows_pull_op(
        self,
        group: str,
        part: str,
        selections: Mapping[str, Any],
        state: bool,
        min_version: int | None,
        deadline: Deadline,
    ) -> Op[dict[str, Array]]: ...

    def _list_rows_op(
        self,
        group: str,
        table: str,
        page_token: str,
        page_size: int,
        values: bool,
        state: bool,
        deadline: Deadline,
    ) -> Op[RowsPage]: ...


class RunningHost(CoreHost, Protocol):
    """A blocking client: it runs an operation to its result (``Client._run``)."""

    def _run(self, op: Op[R]) -> R: ...
