"""Replies as arrays: stream readers, X written into ``out=``, and the small
conversions every transport shares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    header_tensor,
)
from onnxps.wire.initializers import IdsTable
from onnxps.wire.replies import tensor_arrays, tensor_views

from ._errors import InvalidArgumentError
from ._ops import StreamReader, TensorStreamReader
from ._records import initializer_to_proto
from .shm import Segment, SegmentPool

Array = np.ndarray[Any, Any]
_INT64_MAX = (1 << 63) - 1


def written_into(out: Sequence[Array], arrays: Sequence[Array]) -> list[Array]:
    """``out``, holding ``arrays`` (the very arrays when they already are)."""
    out = list(out)
    if len(out) != len(arrays):
        raise ValueError(
            f"out holds {len(out)} arrays; the pull returned {len(arrays)}"
        )
    for i, (o, a) in enumerate(zip(out, arrays, strict=True)):
        if not isinstance(o, np.ndarray) or o.shape != a.shape or o.dtype != a.dtype:
            got = f"{o.dtype} {o.shape}" if isinstance(o, np.ndarray) else type(o)
            raise ValueError(
                f"out[{i}] must be a {a.dtype} array of shape {a.shape}, got {got}"
            )
        if o is not a:
            np.copyto(o, a)
    return out


def reply_arrays(
    out: Any, gradients: Sequence[Any], return_values: bool
) -> list[Array]:
    """A push's ``out``, checked before anything is sent: one writable array per
    gradient, of its shape and dtype (X has the gradient's shape and the group's
    dtype, which a pushed gradient has too)."""
    if not return_values:
        raise ValueError("out= receives X: it needs return_values=True")
    if isinstance(out, np.ndarray):
        raise TypeError("out is a sequence of arrays (one per gradient), not an array")
    arrays = list(out)
    if len(arrays) != len(gradients):
        raise ValueError(
            f"out holds {len(arrays)} arrays for {len(gradients)} gradients: X "
            "comes back as one array per gradient"
        )
    for i, (o, g) in enumerate(zip(arrays, gradients, strict=True)):
        want = np.asarray(g)
        if (
            not isinstance(o, np.ndarray)
            or o.shape != want.shape
            or o.dtype != want.dtype
            or not o.flags.writeable
        ):
            got = (
                f"{'' if o.flags.writeable else 'read-only '}{o.dtype} {o.shape}"
                if isinstance(o, np.ndarray)
                else type(o).__name__
            )
            raise ValueError(
                f"out[{i}] must be a writable {want.dtype} array of shape "
                f"{want.shape} (gradient {i + 1}'s), got {got}"
            )
        if any(np.may_share_memory(o, g) for g in gradients):
            # A resend reads the gradients again, after X may have landed in out.
            raise ValueError(
                f"out[{i}] shares memory with a gradient: X needs arrays of its own"
            )
    return arrays


def inline_values(reply: Any, out: Sequence[Array] | None) -> list[Array]:
    """X carried inline in a Push reply (``values``): copied once at most, into
    ``out`` where it fits (a frame's reply: read where it was received)."""
    if out is None:
        return tensor_arrays(reply, "values")  # one buffer for all of them
    views = tensor_views(reply, "values")
    if out is not None and len(out) == len(views):
        fits = all(
            o.shape == v.shape and o.dtype == v.dtype
            for o, v in zip(out, views, strict=True)
        )
        if fits:
            return written_into(out, views)
    return [v.copy() for v in views]


@contextlib.contextmanager
def released(pool: SegmentPool, segs: list[Segment]) -> Iterator[None]:
    """Give a call's segments back to ``pool`` when it ends, however it ends."""
    try:
        yield
    finally:
        for seg in segs:
            pool.release(seg)


def table_specs(
    tables: Mapping[str, IdsTable],
    table_rows: Sequence[Sequence[Any]] | None,
    arrays: Sequence[Array],
) -> tuple[list[pb.IdsTableSpec], list[list[Array]]]:
    """The IdsTableSpec messages of ``tables`` and their rows (for import)."""
    specs = []
    for name, t in tables.items():
        if not isinstance(t, IdsTable):
            raise TypeError(
                f"tables[{name!r}] must be an IdsTable(dim, ...), got {t!r}"
            )
        if t.dtype is not None and arrays and np.dtype(t.dtype) != arrays[0].dtype:
            raise ValueError(
                f"ids table {name!r} is {np.dtype(t.dtype)}, the group's tensors "
                f"{arrays[0].dtype}: a group has one dtype"
            )
        specs.append(
            pb.IdsTableSpec(
                name=name,
                dim=t.dim,
                initializer=initializer_to_proto(t.initializer),
                max_rows=t.max_rows,
            )
        )
    rows = [[np.asarray(a) for a in r] for r in table_rows or ()]
    if rows and len(rows) != len(specs):
        raise ValueError(
            f"table_rows has {len(rows)} entries for {len(specs)} ids tables"
        )
    return specs, rows


def tcp_host(address: str) -> str | None:
    """The host of a ``host:port`` address (None for unix: and other schemes)."""
    if "/" in address or address.startswith(("unix:", "unix-abstract:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def pull_reader(out: Sequence[Array] | None = None) -> StreamReader:
    def header(m: pb.PullStreamResponse) -> tuple[int, list[pb.Tensor], list[str]]:
        tensors = list(m.header.tensors)
        return m.header.update_count, tensors, [t.name for t in tensors]

    return TensorStreamReader(header, encoded=True, out=out)


def push_reader(out: Sequence[Array] | None = None) -> StreamReader:
    def header(
        m: pb.PushPullStreamResponse,
    ) -> tuple[pb.PushResponse, list[pb.Tensor], list[str]]:
        values = list(m.header.values)
        return m.header, values, [t.name for t in values]

    return TensorStreamReader(header, out=out)


def rows_reader() -> StreamReader:
    def header(m: pb.PullRowsResponse) -> tuple[list[str], list[pb.Tensor], list[str]]:
        rows = list(m.header.rows)
        names = [t.name for t in rows]
        return names, rows, names

    return TensorStreamReader(header)


def row_gradients(
    header: pb.PushRowsHeader, entries: Sequence[tuple[str, Array | None, Array]]
) -> list[Array]:
    """Declare ``(name, indices or None for a dense gradient, values)`` in a row
    push's header; the arrays whose bytes follow it, in order."""
    arrays: list[Array] = []
    for name, indices, values in entries:
        gr = header.gradients.add(name=name)
        if indices is not None:
            gr.indices.CopyFrom(header_tensor(indices))
            arrays.append(indices)
        gr.values.CopyFrom(header_tensor(values))
        arrays.append(values)
    return arrays


def as_indices(idx: Any, name: str = "") -> Array:
    """Row indices or ids as int64, the wire's: any integer dtype, converted exactly
    (a uint64 value above 2**63-1 is refused, not wrapped); InvalidArgumentError (a
    ValueError, reason ROW_INDICES) for any other dtype."""
    indices = np.asarray(idx)
    kind = indices.dtype.kind
    if kind not in "iu":
        raise InvalidArgumentError(
            f"row indices (ids) of {name!r} must be integers (int8 to int64, or "
            f"unsigned up to 2**63-1), sent as int64; got {indices.dtype}",
            reason="ROW_INDICES",
            metadata={"tensor": name, "received": str(indices.dtype)},
        )
    if kind == "u" and indices.dtype.itemsize == 8 and indices.size:
        top = int(indices.max())
        if top > _INT64_MAX:
            raise InvalidArgumentError(
                f"row index (id) {top} of {name!r} does not fit in int64 (at most "
                "2**63-1), the type indices and ids travel as; map it into int64 "
                "first (e.g. ids.view(np.int64), which keeps every id distinct)",
                reason="ROW_INDICES",
                metadata={"tensor": name, "index": str(top)},
            )
    return indices.astype(np.int64, copy=False)


def apply_reader() -> StreamReader:
    def header(m: pb.ApplyStreamResponse) -> tuple[None, list[pb.Tensor], list[str]]:
        outputs = list(m.response.outputs)
        return None, outputs, [f"output {i}" for i in range(len(outputs))]

    return TensorStreamReader(header)
