"""Row pushes and pulls on a cluster: routed to the parts that own the rows.

A tensor of 2+ dims in a split group is split by rows (``_cluster.plan_layout``):
part ``k`` holds rows ``[a, b)`` as a ``(b - a, d1, ...)`` tensor; a 1-D tensor's
element ranges are rows of one element. A row push is checked whole here (names,
indices, shapes, dtype, finiteness), before any part is sent, so parts never
disagree about a refusal; then each owner gets its rows (indices made part-local,
in the order they came, so repeats sum as on one server) and every other part the
same push with no rows, so that every part steps T (docs/embeddings.md, "Row pushes on a
split group"). A row pull asks only the owners and puts the rows back in request
order. A group of ids tables split by id (``_ids_cluster``) lands its row pushes
the same way: ``_ids_cluster.split_push`` says what each part gets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding, encode

from . import _ids_cluster
from ._cluster import Layout, Part, Slot
from ._errors import FailedPreconditionError, InvalidArgumentError
from ._layouts import rerouted
from ._ops import Deadline, Op, on_shard, parallel
from ._records import PushResult
from ._replies import as_indices, row_gradients
from ._sharded import (
    PartPush,
    all_finite,
    check_finite,
    finish_earlier,
    group_dtype,
    pull_rows_part,
)
from ._sharded import land as land_parts
from ._shardops import ShardOps

Array = np.ndarray[Any, Any]

__all__ = ["land", "pull_rows", "push_rows"]

_INDEX = np.dtype(np.int64)


@dataclass(frozen=True)
class _Piece:
    """The rows ``[a, b)`` of a tensor that a part holds, and the piece's name."""

    part: int
    name: str
    a: int
    b: int


def _pieces(found: Layout, tensor: int) -> list[_Piece]:
    """Where the rows of ``tensor`` live; FAILED_PRECONDITION when it is not
    split by rows (a 2+-dim tensor in a layout of an older ops)."""
    shape = found.shapes[tensor]
    if not found.split:
        (p,) = found.parts
        return [_Piece(0, found.names[tensor], 0, shape[0])]
    row = max(1, int(np.prod(shape[1:], dtype=np.int64))) if len(shape) >= 2 else 1
    out = []
    for k, p in enumerate(found.parts):
        for s in p.slots:
            if s.tensor != tensor:
                continue
            if not _row_slot(found, s):
                name = found.names[tensor]
                raise FailedPreconditionError(
                    f"tensor {name!r} of group {found.group!r} is split across the "
                    "cluster by element ranges (a layout of an older ops); row "
                    "pushes and pulls need it split by rows: export the group and "
                    "import it again",
                    reason="CLUSTER_LAYOUT_NOT_BY_ROWS",
                    metadata={"group": found.group, "tensor": name},
                )
            out.append(_Piece(k, found.slot_name(s), s.start // row, s.stop // row))
    return out


def _row_slot(found: Layout, s: Slot) -> bool:
    return s.rows or len(found.shapes[s.tensor]) == 1


def _invalid(found: Layout, message: str, reason: str, **meta: Any) -> Exception:
    metadata = {"group": found.group, **{k: str(v) for k, v in meta.items()}}
    return InvalidArgumentError(message, reason=reason, metadata=metadata)


def _tensor(found: Layout, name: str) -> int:
    if name not in found.names:
        raise _invalid(
            found,
            f"group {found.group!r} has no tensor {name!r}; it holds "
            f"{', '.join(found.names)}",
            "UNKNOWN_TENSOR",
            tensor=name,
        )
    i = found.names.index(name)
    if not found.shapes[i]:
        raise _invalid(
            found,
            f"tensor {name!r} is a scalar: it has no rows",
            "NOT_A_TABLE",
            tensor=name,
        )
    return i


def _checked_indices(found: Layout, i: int, raw: Any) -> Array:
    """int64 (k,) indices in [0, rows): refused here as the server would."""
    name, rows = found.names[i], found.shapes[i][0]
    idx = as_indices(raw, name)
    if idx.dtype != _INDEX or idx.ndim != 1:
        raise _invalid(
            found,
            f"row indices of {name!r} must be int64 of shape (k,), got {idx.dtype} "
            f"{idx.shape}",
            "ROW_INDICES",
            tensor=name,
        )
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise _invalid(
                found,
                f"row index {bad} of {name!r} is out of range: the tensor has {rows} "
                f"rows, indices are in [0, {rows})",
                "ROW_INDEX_OUT_OF_RANGE",
                tensor=name,
                rows=rows,
                index=bad,
            )
    return idx


def _owners(pieces: Sequence[_Piece], idx: Array) -> list[Array]:
    """Per piece, the positions of ``idx`` it owns (ascending: push order)."""
    if len(pieces) == 1:
        return [np.arange(idx.size)]
    stops = np.array([p.b for p in pieces[:-1]], _INDEX)
    which = np.searchsorted(stops, idx, side="right")
    order = np.argsort(which, kind="stable")
    counts = np.bincount(which, minlength=len(pieces))
    return np.split(order, np.cumsum(counts)[:-1])


_Entries = list[list[tuple[str, Array | None, Array]]]


def _split_push(
    ops: ShardOps,
    found: Layout,
    gradients: Mapping[str, Any],
    deadline: Deadline,
    encoding: Encoding = "native",
) -> Op[_Entries]:
    """Each part's row gradients (name on its shard, indices or None, values in
    ``encoding``: encoded whole, once checked, then cut per part)."""
    dtype = group_dtype(ops, found)
    per_part: _Entries = [[] for _ in found.parts]
    finite = True
    for name, g in gradients.items():
        i = _tensor(found, name)
        shape = found.shapes[i]
        pieces = _pieces(found, i)
        if isinstance(g, tuple):
            idx = _checked_indices(found, i, g[0])
            values = np.asarray(g[1])
            expected: tuple[int, ...] = (idx.size, *shape[1:])
        else:
            idx, values, expected = None, np.asarray(g), shape
        if tuple(values.shape) != expected:
            raise _invalid(
                found,
                f"gradient of {name!r} must have shape {expected} "
                f"({'one row per index' if idx is not None else 'the tensor'}), got "
                f"{tuple(values.shape)}",
                "SHAPE_MISMATCH",
                tensor=name,
            )
        if dtype is not None and values.dtype != dtype:
            raise _invalid(
                found,
                f"gradient of {name!r} must be {dtype}, the group's dtype; got "
                f"{values.dtype}",
                "DTYPE_MISMATCH",
                tensor=name,
            )
        finite = finite and all_finite(values)
        values = encode(values, encoding, f"gradient of {name!r}")
        if idx is None:
            flat = np.ascontiguousarray(values).reshape(-1)
            row = values.size // max(1, shape[0])
            for pc in pieces:
                piece = flat[pc.a * row : pc.b * row]
                per_part[pc.part].append((pc.name, None, piece.reshape(-1, *shape[1:])))
            continue
        for pc, mine in zip(pieces, _owners(pieces, idx), strict=True):
            if len(pieces) == 1:
                local, rows = idx - pc.a if pc.a else idx, values
            else:
                local, rows = idx[mine] - pc.a, values[mine]
            per_part[pc.part].append((pc.name, local, rows))
    yield from check_finite(ops, found, finite, deadline)
    return per_part


def push_rows(
    ops: ShardOps,
    group: str,
    gradients: Mapping[str, Any],
    base_version: int | None,
    learning_rate: float | None,
    deadline: Deadline,
    encoding: Encoding = "native",
) -> Op[PushResult]:
    """A row push to a group of a cluster: its parts' pushes, one seq for all,
    every part sent one (with no rows when it owns none of the push's)."""
    yield from finish_earlier(ops, group, deadline)
    seq = ops.next_seq()

    def push_all(found: Layout) -> Op[PushResult]:
        if _ids_cluster.is_ids_layout(found):
            per_part = yield from _ids_cluster.split_push(
                ops, found, gradients, deadline, encoding
            )
        elif not found.split:  # the group's one shard checks it all
            (p,) = found.parts
            op = ops.push_rows(
                group,
                p.name,
                gradients,
                base_version,
                learning_rate,
                deadline,
                encoding,
            )
            return (yield from on_shard(ops.shard_of(p.name, p.shard), op))
        else:
            per_part = yield from _split_push(ops, found, gradients, deadline, encoding)
        return (
            yield from land(
                ops, found, per_part, seq, base_version, learning_rate, deadline
            )
        )

    return (yield from rerouted(ops, group, deadline, push_all))


def land(
    ops: ShardOps,
    found: Layout,
    per_part: _Entries,
    seq: int,
    base_version: int | None,
    learning_rate: float | None,
    deadline: Deadline,
) -> Op[PushResult]:
    """Send every part its row gradients with one (client_id, seq); parts that did
    not answer are resent with that seq until the deadline, and a part still
    missing is sent first by the next push to the group (``_sharded.land``), so
    every part takes the push exactly once and all keep the same T."""

    def part(k: int, with_base: bool) -> PartPush:
        p: Part = found.parts[k]
        header = pb.PushRowsHeader(group=p.name, client_id=ops.client_id, seq=seq)
        if with_base and base_version is not None:
            header.base_version = base_version
        if learning_rate is not None:
            header.learning_rate = learning_rate
        return p.shard, header, row_gradients(header, per_part[k])

    count = len(found.parts)
    if base_version is not None:
        # Part 0 alone decides whether the push is too stale (as dense pushes).
        rest = [part(k, False) for k in range(1, count)]
        replies = yield from land_parts(
            ops, found.group, [part(0, True)], rest, deadline
        )
    else:
        every = [part(k, True) for k in range(count)]
        replies = yield from land_parts(ops, found.group, every, (), deadline)
    return PushResult(
        max(int(m.update_count) for m in replies),
        all(m.applied for m in replies),
        all(m.duplicate for m in replies),
        None,
    )


def pull_rows(
    ops: ShardOps,
    group: str,
    selections: Mapping[str, Any],
    state: bool,
    min_version: int | None,
    deadline: Deadline,
) -> Op[dict[str, Array]]:
    """Rows of a group of a cluster, from the parts that own them (a selection
    with no rows asks the part holding the tensor's first rows); this client's
    pending pushes to the group are sent first."""
    yield from finish_earlier(ops, group, deadline)

    def pull_all(found: Layout) -> Op[dict[str, Array]]:
        if _ids_cluster.is_ids_layout(found):
            return (
                yield from _ids_cluster.pull_rows(
                    ops, found, selections, state, min_version, deadline
                )
            )
        asks: list[dict[str, Array]] = [{} for _ in found.parts]
        # per selection: its tensor, and (part, piece name, positions) it reads
        plan: list[tuple[str, int, list[tuple[int, str, Array]]]] = []
        for name, raw in selections.items():
            i = _tensor(found, name)
            pieces = _pieces(found, i)
            idx = _checked_indices(found, i, raw)
            reads = []
            for pc, mine in zip(pieces, _owners(pieces, idx), strict=True):
                if mine.size == 0 and (idx.size or pc is not pieces[0]):
                    continue
                local = idx[mine] - pc.a if len(pieces) > 1 else idx - pc.a
                asks[pc.part][pc.name] = local
                reads.append((pc.part, pc.name, mine))
            plan.append((name, idx.size, reads))
        asked = [k for k, a in enumerate(asks) if a]
        replies = yield from parallel(
            [
                pull_rows_part(ops, found, k, asks[k], state, min_version, deadline)
                for k in asked
            ]
        )
        got = dict(zip(asked, replies, strict=True))
        prefixes = [""]
        first = got[asked[0]] if asked else {}
        prefixes += [p for p in ("V:", "H:") if any(n.startswith(p) for n in first)]
        out: dict[str, Array] = {}
        for prefix in prefixes:
            for name, k_rows, reads in plan:
                got_rows = [got[k][prefix + piece] for k, piece, _ in reads]
                if len(reads) == 1:
                    out[prefix + name] = got_rows[0]
                    continue
                whole = np.empty((k_rows, *got_rows[0].shape[1:]), got_rows[0].dtype)
                for (_, _, mine), rows in zip(reads, got_rows, strict=True):
                    whole[mine] = rows
                out[prefix + name] = whole
        return out

    return (yield from rerouted(ops, group, deadline, pull_all))
