"""The RPCs about groups as a whole: create, describe, list, delete, the learning
rate, Apply (one ONNX node, no state), workers' leases and Save."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    PROTO_TO_DTYPE,
    chunk_frames,
    declared_nbytes,
    header_tensor,
    tensor_spec,
    tensor_to_array,
    write_tensor,
)

from ..errors import FailedPrecondition, InvalidArgument
from ..kernels import apply_onnx
from ..store import LeaseView
from ._common import RpcFamily, names_of, stream_header, streaming, unary
from ._convert import (
    attrs_from_proto,
    consistency_from_proto,
    decoded,
    group_info,
    table_from_proto,
)

__all__ = ["GroupRpcs"]

log = logging.getLogger("onnxps.service")

Array = np.ndarray[Any, Any]

L = TypeVar("L", pb.JoinGroupResponse, pb.HeartbeatResponse, pb.LeaveGroupResponse)


def _table_tensors(t: pb.IdsTableSpec) -> tuple[list[pb.Tensor], list[str]]:
    """The tensors an ids table spec carries (import): ids, rows, state."""
    if not t.HasField("ids"):
        return [], []
    what = f"ids table {t.name!r}"
    headers = [t.ids, t.rows, *t.state]
    names = [f"{what} ids", f"{what} rows"] + [
        f"{what} state {i + 1}" for i in range(len(t.state))
    ]
    return headers, names


def _empty_table(dim: int, dtype: np.dtype[Any], attrs: Any) -> list[Array]:
    empty = np.empty((0, dim), dtype)
    return [np.empty(0, np.int64), empty] + [empty for _ in attrs.state_names]


class GroupRpcs(RpcFamily):
    """CreateGroup, CreateGroupStream, DescribeGroup, ListGroups, DeleteGroup,
    SetLearningRate, Apply, ApplyStream, JoinGroup, Heartbeat, LeaveGroup, Save."""

    def _create(
        self,
        req: pb.CreateGroupRequest,
        tensors: list[Array],
        state: list[Array],
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> pb.GroupInfo:
        attrs = attrs_from_proto(req.optimizer)
        names = [t.name for t in req.tensors]
        tables = [table_from_proto(t) for t in req.tables]
        dtype = None
        if req.dtype != pb.DATA_TYPE_UNSPECIFIED:
            dtype = PROTO_TO_DTYPE.get(req.dtype)
            if dtype is None or dtype.kind != "f":
                raise InvalidArgument(
                    f"a group's dtype is FLOAT or DOUBLE, got DataType {req.dtype}"
                )
            dtype = dtype.newbyteorder("=")
            if tensors and tensors[0].dtype != dtype:
                raise InvalidArgument(
                    f"the group's dtype is {dtype}, but its tensors are "
                    f"{tensors[0].dtype}"
                )
        if any(a for a in table_arrays):
            table_arrays = [
                list(a) or _empty_table(t.dim, dtype or np.dtype(np.float32), attrs)
                for t, a in zip(tables, table_arrays, strict=True)
            ]
        else:
            table_arrays = ()
        view = self.store.create_group(
            req.group,
            attrs,
            req.learning_rate,
            list(zip(names, tensors, strict=True)),
            consistency=consistency_from_proto(req.consistency),
            allow_non_finite=req.allow_non_finite,
            state=state,
            update_count=req.update_count,
            lease_seconds=req.lease_seconds or None,
            tables=tables,
            table_arrays=table_arrays,
            dtype=dtype,
            request_id=req.request_id,
        )
        return group_info(view)

    def _check_create_size(self, req: pb.CreateGroupRequest) -> None:
        """Refuse an oversized group from its declared dims, before allocating."""
        nbytes = sum(declared_nbytes(t, f"tensor {t.name!r}") for t in req.tensors)
        kind = req.optimizer.WhichOneof("kind")
        states = {"adagrad": 1, "momentum": 1, "adam": 2}.get(kind or "", 0)
        rows = sum(
            declared_nbytes(t.rows, f"rows of ids table {t.name!r}")
            for t in req.tables
            if t.HasField("rows")
        )
        self.store.check_group_size((nbytes + rows) * (1 + states))
        if not req.tensors and not req.tables:
            raise InvalidArgument(
                f"group {req.group!r} needs at least one tensor or ids table"
            )

    @unary
    def CreateGroup(
        self, request: pb.CreateGroupRequest, context: Any
    ) -> pb.CreateGroupResponse:
        self._check_create_size(request)
        tensors = [
            decoded(t, f"tensor {t.name!r}", f"tensors[{i}]")
            for i, t in enumerate(request.tensors)
        ]
        state = [
            decoded(t, f"state {i + 1}", f"state[{i}]")
            for i, t in enumerate(request.state)
        ]
        table_arrays = [
            [tensor_to_array(h, w) for h, w in zip(*_table_tensors(t), strict=True)]
            for t in request.tables
        ]
        return pb.CreateGroupResponse(
            group=self._create(request, tensors, state, table_arrays)
        )

    @unary
    def CreateGroupStream(
        self, request_iterator: Iterable[pb.CreateGroupStreamRequest], context: Any
    ) -> pb.CreateGroupStreamResponse:
        req, it = stream_header(
            request_iterator, "header", "a CreateGroupStream", context
        )
        self._check_create_size(req)
        headers = list(req.tensors) + list(req.state)
        names = [f"tensor {t.name!r}" for t in req.tensors] + names_of(
            "state", len(req.state)
        )
        per_table = [_table_tensors(t) for t in req.tables]
        for h, w in per_table:
            headers += h
            names += w
        asm = self._assemble(it, headers, names, context)
        n, m = len(req.tensors), len(req.tensors) + len(req.state)
        table_arrays: list[list[Array]] = []
        for h, _ in per_table:
            table_arrays.append(asm[m : m + len(h)])
            m += len(h)
        return pb.CreateGroupStreamResponse(
            group=self._create(
                req, asm[:n], asm[n : len(req.tensors) + len(req.state)], table_arrays
            )
        )

    @unary
    def DescribeGroup(
        self, request: pb.DescribeGroupRequest, context: Any
    ) -> pb.DescribeGroupResponse:
        return pb.DescribeGroupResponse(
            group=group_info(self.store.describe(request.group))
        )

    @unary
    def ListGroups(
        self, request: pb.ListGroupsRequest, context: Any
    ) -> pb.ListGroupsResponse:
        return pb.ListGroupsResponse(
            groups=[group_info(v) for v in self.store.groups(request.prefix)]
        )

    @unary
    def DeleteGroup(
        self, request: pb.DeleteGroupRequest, context: Any
    ) -> pb.DeleteGroupResponse:
        deleted = self.store.delete_group(request.group)
        self.gradient_pool.drop(request.group)
        return pb.DeleteGroupResponse(deleted=deleted)

    @unary
    def SetLearningRate(
        self, request: pb.SetLearningRateRequest, context: Any
    ) -> pb.SetLearningRateResponse:
        view = self.store.set_learning_rate(request.group, request.learning_rate)
        return pb.SetLearningRateResponse(group=group_info(view))

    def _apply(self, req: pb.ApplyRequest, inputs: list[Array]) -> list[Array]:
        attrs = attrs_from_proto(req.optimizer)
        return apply_onnx(attrs.op, attrs, inputs)

    @unary
    def Apply(self, request: pb.ApplyRequest, context: Any) -> pb.ApplyResponse:
        inputs = [
            tensor_to_array(t, f"input {i}") for i, t in enumerate(request.inputs)
        ]
        outputs = self._apply(request, inputs)
        reply = pb.ApplyResponse()
        for o in outputs:
            write_tensor(reply.outputs.add(), o)
        return reply

    @streaming
    def ApplyStream(
        self, request_iterator: Iterable[pb.ApplyStreamRequest], context: Any
    ) -> Iterator[Any]:
        request, it = stream_header(
            request_iterator, "request", "an ApplyStream", context
        )
        headers = list(request.inputs)
        for i, t in enumerate(headers):
            tensor_spec(t, f"input {i}")
        inputs = self._assemble(
            it, headers, [f"input {i}" for i in range(len(headers))], context
        )
        outputs = self._apply(request, inputs)
        yield pb.ApplyStreamResponse(
            response=pb.ApplyResponse(outputs=[header_tensor(o) for o in outputs])
        )
        yield from chunk_frames(pb.ApplyStreamResponse, outputs, self.chunk_bytes)

    def _lease(self, lease: LeaseView, reply_type: type[L]) -> L:
        return reply_type(
            lease_seconds=lease.lease_seconds,
            update_count=lease.update_count,
            live_workers=lease.live_workers,
            quorum=lease.quorum,
        )

    @unary
    def JoinGroup(
        self, request: pb.JoinGroupRequest, context: Any
    ) -> pb.JoinGroupResponse:
        lease = self.store.join(request.group, request.worker_id)
        return self._lease(lease, pb.JoinGroupResponse)

    @unary
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Any
    ) -> pb.HeartbeatResponse:
        lease = self.store.join(request.group, request.worker_id)
        return self._lease(lease, pb.HeartbeatResponse)

    @unary
    def LeaveGroup(
        self, request: pb.LeaveGroupRequest, context: Any
    ) -> pb.LeaveGroupResponse:
        lease = self.store.leave(request.group, request.worker_id)
        return self._lease(lease, pb.LeaveGroupResponse)

    @unary
    def Save(self, request: pb.SaveRequest, context: Any) -> pb.SaveResponse:
        if self._save is None:
            # Not UNAVAILABLE: the client retries that, and no retry will help.
            raise FailedPrecondition(
                "this server keeps no data directory (started with --durability none):"
                " start it with --data-dir and --durability snapshot or wal to save"
            )
        saved = self._save()
        return pb.SaveResponse(path=saved.path, groups=saved.groups, bytes=saved.bytes)
