"""Row-sparse pushes and pulls on (rows, ...) tensors (no grpc here).

A row push steps only the rows it names: each row steps with the ONNX operator
applied to that row alone, with the group's R and T ("lazy": rows not named keep
X, V and H). The rows are gathered into contiguous buffers, stepped by a
``Stepper`` (the dense production path) and scattered back; the operators are
element-wise, so a row steps bit for bit as it would in a dense push.

A push travels through the store (validation, exactly-once, sync buffering, the
log) as a flat list of arrays, one or two per tensor of the group in ONNX order:

- a dense gradient: the array itself (float32/float64, the tensor's shape);
- a row gradient: its int64 indices (k,), then its rows (k, shape[1:]...).

The int64 indices mark a row gradient: a gradient is never int64. A tensor a push
does not name is a row gradient with no rows. Row gradients in that list are
coalesced: indices ascending and unique, repeats summed left to right in the
order they came (the sum starts from the first occurrence, not from zero).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..kernels import OptimizerAttrs, Stepper

__all__ = [
    "INDEX_DTYPE",
    "RowGradient",
    "check_indices",
    "coalesce",
    "combine_rows",
    "gather_rows",
    "split_row_push",
    "step_rows",
]

Array = np.ndarray[Any, Any]
INDEX_DTYPE = np.dtype(np.int64)


@dataclass(frozen=True)
class RowGradient:
    """Rows of one tensor's gradient: ``values[j]`` is the gradient of row
    ``indices[j]``."""

    indices: Array  # int64 (k,)
    values: Array  # (k, shape[1:]...)


Part = Array | RowGradient


def split_row_push(arrays: Sequence[Array]) -> list[Part]:
    """The per-tensor parts of a flat row push (see the module docstring)."""
    parts: list[Part] = []
    i = 0
    while i < len(arrays):
        a = arrays[i]
        if a.dtype == INDEX_DTYPE:
            if i + 1 >= len(arrays):
                raise InvalidArgument("a row push ends with indices and no rows")
            parts.append(RowGradient(a, arrays[i + 1]))
            i += 2
        else:
            parts.append(a)
            i += 1
    return parts


def flatten(parts: Sequence[Part]) -> list[Array]:
    out: list[Array] = []
    for p in parts:
        if isinstance(p, RowGradient):
            out += [p.indices, p.values]
        else:
            out.append(p)
    return out


def check_indices(indices: Array, rows: int, what: str, group: str) -> Array:
    """int64 indices, 1-d, each in [0, rows); INVALID_ARGUMENT otherwise."""
    idx = np.asarray(indices)
    if idx.dtype != INDEX_DTYPE or idx.ndim != 1:
        raise InvalidArgument(
            f"{what}: row indices must be int64 of shape (k,), got {idx.dtype} "
            f"{idx.shape}",
            reason="ROW_INDICES",
            field=what,
            metadata={"group": group},
        )
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise InvalidArgument(
            f"{what}: row index {bad} is out of range: the tensor has {rows} rows, "
            f"indices are in [0, {rows})",
            reason="ROW_INDEX_OUT_OF_RANGE",
            field=what,
            metadata={"group": group, "rows": rows, "index": bad},
        )
    return idx


def coalesce(indices: Array, values: Array) -> RowGradient:
    """Unique ascending indices; repeated ones summed left to right in push order.

    The sum of a repeated index starts from its first row and adds the later ones
    in the order they came, one pass per repeat (``np.add.at`` would do the same
    order but is slower for few repeats)."""
    if indices.size == 0:
        return RowGradient(indices.astype(INDEX_DTYPE), values)
    order, s_idx = _stable_order(indices)
    starts = np.flatnonzero(np.r_[True, s_idx[1:] != s_idx[:-1]])
    if starts.size == s_idx.size:  # no repeats
        return RowGradient(s_idx, values[order])
    out = values[order[starts]]  # first occurrences, a copy
    counts = np.diff(np.r_[starts, s_idx.size])
    for r in range(1, int(counts.max())):
        has = counts > r  # the (r+1)-th occurrence, at unique positions of ``out``
        out[has] += values[order[starts[has] + r]]
    return RowGradient(s_idx[starts], out)


def _stable_order(indices: Array) -> tuple[Array, Array]:
    """``argsort(indices, kind="stable")`` and the sorted indices.

    Sorting the keys ``index * k + position`` (unique, so any sort is stable) gives
    the same order several times faster than a stable argsort of int64, when the
    keys fit in int64 (indices in [0, 2**62 / k))."""
    k = indices.size
    if int(indices.min()) >= 0 and int(indices.max()) < (1 << 62) // k:
        key = indices * k + np.arange(k, dtype=INDEX_DTYPE)
        key.sort()
        return key % k, key // k
    order = np.argsort(indices, kind="stable")
    return order, indices[order]


def gather_rows(x: Array, shape: tuple[int, ...], indices: Array) -> Array:
    """Copies of rows ``indices`` of the flat tensor ``x`` of ``shape``."""
    return x.reshape(shape)[indices]


def _stepper(
    cache: dict[int, Stepper], attrs: OptimizerAttrs, dtype: np.dtype[Any], size: int
) -> Stepper:
    # A stepper owns its scratch, so the cache belongs to one group (stepped under
    # its lock): one stepper per size, reused by the pushes of that size.
    s = cache.get(size)
    if s is None:
        if len(cache) >= 32:
            cache.clear()
        s = cache[size] = Stepper(attrs, dtype, [size])
    return s


def step_rows(
    attrs: OptimizerAttrs,
    r: float,
    t: int,
    xs: Sequence[Array],
    shapes: Sequence[tuple[int, ...]],
    states: Mapping[str, Sequence[Array]],
    parts: Sequence[Part],
    cache: dict[int, Stepper],
) -> None:
    """One ONNX step at T=t in place: dense parts step whole tensors, row parts
    step their (coalesced, unique) rows only. Not thread-safe (the group's lock)."""
    dtype = xs[0].dtype
    fused = _stepper(cache, attrs, dtype, 0)  # its fused row kernel, if any
    for i, part in enumerate(parts):
        x = xs[i]
        v = states["V"][i] if "V" in states else None
        h = states["H"][i] if "H" in states else None
        if not isinstance(part, RowGradient):
            g = np.ascontiguousarray(part, dtype=dtype).reshape(-1)
            stepper = _stepper(cache, attrs, dtype, x.size)
            stepper.step(r, t, [x], [g], _one(v), _one(h))
            continue
        idx = part.indices
        if idx.size == 0:
            continue
        shape = shapes[i]
        g = np.ascontiguousarray(part.values, dtype=dtype).reshape(-1)
        row = x.size // max(1, shape[0])
        if fused.step_rows(r, t, x, g, v, h, idx, row):
            continue
        xr = gather_rows(x, shape, idx).reshape(-1)
        vr = gather_rows(v, shape, idx).reshape(-1) if v is not None else None
        hr = gather_rows(h, shape, idx).reshape(-1) if h is not None else None
        _stepper(cache, attrs, dtype, xr.size).step(r, t, [xr], [g], _one(vr), _one(hr))
        rows = (idx.size, *shape[1:])
        x.reshape(shape)[idx] = xr.reshape(rows)
        if v is not None and vr is not None:
            v.reshape(shape)[idx] = vr.reshape(rows)
        if h is not None and hr is not None:
            h.reshape(shape)[idx] = hr.reshape(rows)


def _one(a: Array | None) -> list[Array] | None:
    return None if a is None else [a]


def combine_rows(
    contributions: Mapping[str, Sequence[Array]], reduction: str, dtype: np.dtype[Any]
) -> list[Array]:
    """A sync step's gradient from contributions some of which are row pushes.

    Per tensor, in client-id order as ``combine_contributions``: if every
    contribution has rows of it, their rows are concatenated in that order and
    coalesced (a row's contributions summed left to right); if any is dense, the
    sum is dense (rows added into zeros, dense ones added whole). ``mean`` divides
    by the number of contributions, as for dense pushes. Returns a flat list.
    """
    keys = sorted(contributions)
    per_client = [split_row_push(contributions[k]) for k in keys]
    n = len(per_client[0])
    count = dtype.type(len(keys))
    out: list[Part] = []
    for i in range(n):
        parts = [c[i] for c in per_client]
        dense = [p for p in parts if not isinstance(p, RowGradient)]
        if dense:
            acc = np.zeros(dense[0].shape, dtype)
            for p in parts:
                if isinstance(p, RowGradient):
                    if p.indices.size:  # (0, -1) is no shape to reshape to
                        flat = acc.reshape(acc.shape[0], -1)
                        flat[p.indices] += p.values.reshape(p.indices.size, -1)
                else:
                    np.add(acc, p, out=acc)
            if reduction == "mean" and len(keys) > 1:
                np.divide(acc, count, out=acc)
            out.append(acc)
            continue
        rows = [p for p in parts if isinstance(p, RowGradient)]
        idx = np.concatenate([p.indices for p in rows])
        vals = np.concatenate([p.values for p in rows])
        merged = coalesce(idx, vals)
        values = np.array(merged.values, dtype=dtype, copy=True)
        if reduction == "mean" and len(keys) > 1:
            np.divide(values, count, out=values)
        out.append(RowGradient(merged.indices, values))
    return flatten(out)


RowSpec = tuple[
    str,
    tuple[np.dtype[Any], tuple[int, ...]] | None,
    tuple[np.dtype[Any], tuple[int, ...]],
]


def check_row_specs(
    group: str,
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtype: np.dtype[Any],
    specs: Sequence[RowSpec],
) -> list[int]:
    """Check a row push's header (names, dtypes, shapes) before any bytes are read;
    returns each gradient's tensor position."""
    positions: list[int] = []
    for j, (name, index_spec, value_spec) in enumerate(specs):
        where = f"gradients[{j}]"
        if name not in names:
            raise InvalidArgument(
                f"group {group!r} has no tensor {name!r}; it holds {', '.join(names)}",
                reason="UNKNOWN_TENSOR",
                field=f"{where}.name",
                metadata={"group": group, "tensor": name},
            )
        i = names.index(name)
        if i in positions:
            raise InvalidArgument(
                f"tensor {name!r} is named twice in one row push; put its rows in "
                "one gradient (repeated indices are summed)",
                reason="DUPLICATE_TENSOR",
                field=f"{where}.name",
                metadata={"group": group, "tensor": name},
            )
        positions.append(i)
        vdtype, vshape = value_spec
        if np.dtype(vdtype) != dtype:
            raise InvalidArgument(
                f"gradient of {name!r} must be {dtype}, the group's dtype; got "
                f"{np.dtype(vdtype)}",
                reason="DTYPE_MISMATCH",
                field=f"{where}.values.dtype",
                metadata={"group": group, "expected": dtype, "received": vdtype},
            )
        shape = shapes[i]
        if index_spec is None:
            expected = shape
        else:
            idtype, ishape = index_spec
            if not shape:
                raise InvalidArgument(
                    f"tensor {name!r} is a scalar: it has no rows to push",
                    reason="NOT_A_TABLE",
                    field=f"{where}.indices",
                    metadata={"group": group, "tensor": name},
                )
            if np.dtype(idtype) != INDEX_DTYPE or len(ishape) != 1:
                raise InvalidArgument(
                    f"row indices of {name!r} must be int64 of shape (k,), got "
                    f"{np.dtype(idtype)} {tuple(ishape)}",
                    reason="ROW_INDICES",
                    field=f"{where}.indices",
                    metadata={"group": group, "tensor": name},
                )
            expected = (int(ishape[0]), *shape[1:])
        if tuple(vshape) != tuple(expected):
            raise InvalidArgument(
                f"gradient of {name!r} must have shape {tuple(expected)} "
                f"({'one row per index' if index_spec else 'the tensor'}), got "
                f"{tuple(vshape)}",
                reason="SHAPE_MISMATCH",
                field=f"{where}.values.dims",
                metadata={"group": group, "expected": expected, "received": vshape},
            )
    return positions


def row_push_parts(
    group: str,
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtype: np.dtype[Any],
    gradients: Mapping[str, Array | tuple[Array, Array]],
) -> list[Part]:
    """A row push checked (header and index values) and coalesced, one part per
    tensor in ONNX order; tensors not named get a row gradient with no rows."""
    specs: list[RowSpec] = []
    items: list[tuple[Array | None, Array]] = []
    for name, g in gradients.items():
        if isinstance(g, tuple):
            idx, vals = np.asarray(g[0]), np.asarray(g[1])
            specs.append((name, (idx.dtype, idx.shape), (vals.dtype, vals.shape)))
            items.append((idx, vals))
        else:
            vals = np.asarray(g)
            specs.append((name, None, (vals.dtype, vals.shape)))
            items.append((None, vals))
    positions = check_row_specs(group, names, shapes, dtype, specs)
    parts: list[Part | None] = [None] * len(names)
    for j, ((raw, values), i) in enumerate(zip(items, positions, strict=True)):
        if raw is None:
            parts[i] = values
            continue
        idx = check_indices(raw, shapes[i][0], f"gradients[{j}].indices", group)
        parts[i] = coalesce(idx, values)
    return [
        p
        if p is not None
        else RowGradient(np.empty(0, INDEX_DTYPE), np.empty((0, *shapes[i][1:]), dtype))
        for i, p in enumerate(parts)
    ]
