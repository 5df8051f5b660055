"""Protobuf messages <-> server domain objects (attributes, consistency, group info)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    DTYPE_TO_PROTO,
    TensorFormatError,
    tensor_spec,
    tensor_to_array,
)
from onnxps.wire.image import TableDefinition

from ..errors import InvalidArgument
from ..kernels import OptimizerAttrs, make_attrs
from ..store import Consistency, GroupView

__all__ = [
    "attrs_from_proto",
    "attrs_to_proto",
    "consistency_from_proto",
    "consistency_to_proto",
    "decoded",
    "group_info",
    "index_spec",
    "initializer_from_proto",
    "table_from_proto",
]

_INIT_KINDS = {
    pb.ROW_INITIALIZER_KIND_UNSPECIFIED: "zeros",
    pb.ROW_INITIALIZER_KIND_ZEROS: "zeros",
    pb.ROW_INITIALIZER_KIND_UNIFORM: "uniform",
    pb.ROW_INITIALIZER_KIND_NORMAL: "normal",
}

_KIND_TO_OP = {"adagrad": "Adagrad", "momentum": "Momentum", "adam": "Adam"}
_OP_TO_KIND = {v: k for k, v in _KIND_TO_OP.items()}


def attrs_from_proto(spec: pb.OptimizerSpec) -> OptimizerAttrs:
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(
            "optimizer is not set: expected one of adagrad, momentum or adam"
        )
    msg = getattr(spec, kind)
    given: dict[str, Any] = {
        f.name: getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
        if msg.HasField(f.name)
    }
    return make_attrs(_KIND_TO_OP[kind], given)


def attrs_to_proto(attrs: OptimizerAttrs) -> pb.OptimizerSpec:
    kind = _OP_TO_KIND[attrs.op]
    msg_cls = {"adagrad": pb.Adagrad, "momentum": pb.Momentum, "adam": pb.Adam}[kind]
    return pb.OptimizerSpec(**{kind: msg_cls(**asdict(attrs))})


def consistency_from_proto(c: pb.Consistency) -> Consistency:
    mode = "sync" if c.mode == pb.CONSISTENCY_MODE_SYNC else "async"
    if c.mode not in (
        pb.CONSISTENCY_MODE_UNSPECIFIED,
        pb.CONSISTENCY_MODE_ASYNC,
        pb.CONSISTENCY_MODE_SYNC,
    ):
        raise InvalidArgument(
            f"unknown consistency mode {c.mode}: expected ASYNC or SYNC"
        )
    if c.reduction not in (
        pb.REDUCTION_UNSPECIFIED,
        pb.REDUCTION_MEAN,
        pb.REDUCTION_SUM,
    ):
        raise InvalidArgument(f"unknown reduction {c.reduction}: expected MEAN or SUM")
    return Consistency(
        mode=mode,
        sync_workers=c.sync_workers,
        reduction="sum" if c.reduction == pb.REDUCTION_SUM else "mean",
        max_staleness=c.max_staleness if c.HasField("max_staleness") else None,
    )


def consistency_to_proto(c: Consistency) -> pb.Consistency:
    msg = pb.Consistency(
        mode=pb.CONSISTENCY_MODE_SYNC
        if c.mode == "sync"
        else pb.CONSISTENCY_MODE_ASYNC,
        sync_workers=c.sync_workers,
        reduction=pb.REDUCTION_SUM if c.reduction == "sum" else pb.REDUCTION_MEAN,
    )
    if c.max_staleness is not None:
        msg.max_staleness = c.max_staleness
    return msg


def group_info(view: GroupView) -> pb.GroupInfo:
    return pb.GroupInfo(
        name=view.name,
        optimizer=attrs_to_proto(view.attrs),
        learning_rate=view.learning_rate,
        update_count=view.update_count,
        dtype=DTYPE_TO_PROTO[view.dtype.newbyteorder("<")],
        tensors=[
            pb.TensorInfo(name=n, dims=s)
            for n, s in zip(view.names, view.shapes, strict=True)
        ],
        consistency=consistency_to_proto(view.consistency),
        allow_non_finite=view.allow_non_finite,
        element_count=view.element_count,
        state_bytes=view.state_bytes,
        lease_seconds=view.lease_seconds,
        workers=[
            pb.WorkerInfo(
                worker_id=w.worker_id,
                alive=True,
                lease_remaining_seconds=w.lease_remaining_seconds,
            )
            for w in view.workers
        ]
        + [pb.WorkerInfo(worker_id=w, alive=False) for w in view.dead_workers],
        pending_contributions=view.pending,
        quorum=view.quorum,
        layout=view.layout,
        tables=[
            pb.IdsTableInfo(
                name=t.name,
                dim=t.definition.dim,
                initializer=initializer_to_proto(t.definition.initializer),
                max_rows=t.definition.max_rows,
                row_count=t.row_count,
            )
            for t in view.tables
        ],
    )


def initializer_from_proto(msg: pb.RowInitializer) -> dict[str, Any]:
    """An ids table's initializer as its JSON (``onnxps.wire.initializers``)."""
    kind = _INIT_KINDS.get(msg.kind)
    if kind is None:
        raise InvalidArgument(
            f"unknown row initializer kind {msg.kind}: expected ZEROS, UNIFORM or "
            "NORMAL"
        )
    if kind == "uniform":
        return {"kind": kind, "low": msg.low, "high": msg.high, "seed": msg.seed}
    if kind == "normal":
        return {
            "kind": kind,
            "mean": msg.mean,
            "std": msg.stddev,
            "seed": msg.seed,
            "truncated": msg.truncated,
        }
    return {"kind": "zeros"}


def initializer_to_proto(doc: Mapping[str, Any]) -> pb.RowInitializer:
    kind = doc["kind"]
    if kind == "uniform":
        return pb.RowInitializer(
            kind=pb.ROW_INITIALIZER_KIND_UNIFORM,
            low=doc["low"],
            high=doc["high"],
            seed=doc["seed"],
        )
    if kind == "normal":
        return pb.RowInitializer(
            kind=pb.ROW_INITIALIZER_KIND_NORMAL,
            mean=doc["mean"],
            stddev=doc["std"],
            seed=doc["seed"],
            truncated=doc["truncated"],
        )
    return pb.RowInitializer(kind=pb.ROW_INITIALIZER_KIND_ZEROS)


def table_from_proto(spec: pb.IdsTableSpec) -> TableDefinition:
    return TableDefinition(
        name=spec.name,
        dim=int(spec.dim),
        initializer=initializer_from_proto(spec.initializer),
        max_rows=int(spec.max_rows),
    )


def index_spec(t: pb.Tensor, what: str, group: str) -> tuple[Any, tuple[int, ...]]:
    """The dtype and dims of row indices or ids: ``DATA_TYPE_INT64`` of dims [k]
    with no encoding, else INVALID_ARGUMENT (``ROW_INDICES``), whatever another
    language sends."""
    if t.dtype != pb.DATA_TYPE_INT64 or len(t.dims) != 1 or t.encoding:
        try:
            name = pb.DataType.Name(t.dtype)
        except ValueError:
            name = "not a DataType"
        encoded = f" encoded as {t.encoding}" if t.encoding else ""
        raise InvalidArgument(
            f"{what} must be DATA_TYPE_INT64 (7) with dims [k] and no encoding: "
            "row indices and ids travel as int64; got data type "
            f"{t.dtype} ({name}) with dims {list(t.dims)}{encoded}",
            reason="ROW_INDICES",
            field=what,
            metadata={"group": group, "received": t.dtype},
        )
    return tensor_spec(t, what)


def decoded(
    t: pb.Tensor, what: str, field: str, *, encoded: bool = False
) -> np.ndarray[Any, Any]:
    """``tensor_to_array``, refusing a malformed tensor as INVALID_TENSOR that names
    the request ``field`` at fault (the BadRequest a client in any language reads)."""
    try:
        return tensor_to_array(t, what, encoded=encoded)
    except TensorFormatError as exc:
        raise InvalidArgument(str(exc), reason="INVALID_TENSOR", field=field) from None
