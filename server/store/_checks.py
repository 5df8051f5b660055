"""Value checks for a group's definition: every value that would make a group unusable
is refused when it is given (create, import, restore, set_learning_rate, push).

Each check raises ``InvalidArgument`` naming the value and the allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from onnxps.wire.image import (
    GroupDefinition,
    GroupImage,
    ImageFormatError,
    TableDefinition,
)
from onnxps.wire.initializers import initializer_from_json

from ..errors import InvalidArgument
from ..kernels import STATE_DTYPES, OptimizerAttrs
from ..kernels._finite import all_finite
from ._group import check_name

__all__ = [
    "MAX_LEASE_SECONDS",
    "MAX_UPDATE_COUNT",
    "check_learning_rate",
    "check_lease_seconds",
    "check_state",
    "check_tables",
    "check_tensors",
    "check_update_count",
]

Array = np.ndarray[Any, Any]

# T travels as int64: it stays at or below 2**62, far from 2**63 - 1, so no step,
# reply or saved form can overflow it.
MAX_UPDATE_COUNT = 2**62
MAX_LEASE_SECONDS = 86_400.0  # a day: a longer lease is a worker that never dies


def check_update_count(update_count: int) -> None:
    if update_count < 0:
        raise InvalidArgument(
            f"update_count must be >= 0, got {update_count}", field="update_count"
        )
    if update_count > MAX_UPDATE_COUNT:
        raise InvalidArgument(
            f"update_count must be <= 2**62 = {MAX_UPDATE_COUNT} (T is an int64 "
            f"that must not overflow), got {update_count}",
            field="update_count",
        )


def check_lease_seconds(lease_seconds: float) -> None:
    if not (math.isfinite(lease_seconds) and 0 < lease_seconds <= MAX_LEASE_SECONDS):
        raise InvalidArgument(
            f"lease_seconds must be finite, > 0 and <= {MAX_LEASE_SECONDS:g}, got "
            f"{lease_seconds!r}",
            field="lease_seconds",
        )


def check_learning_rate(
    learning_rate: float, dtype: np.dtype[Any], what: str = "learning_rate"
) -> None:
    """R is finite, >= 0, and finite once rounded to the group's dtype."""
    r = float(learning_rate)
    with np.errstate(over="ignore"):
        fits = math.isfinite(r) and math.isfinite(float(np.dtype(dtype).type(r)))
    if not fits or r < 0:
        limit = float(np.finfo(dtype).max)
        raise InvalidArgument(
            f"{what} must be finite and in [0, {limit:g}] (the group's dtype is "
            f"{np.dtype(dtype)}), got {learning_rate!r}",
            field="learning_rate",
        )


def check_tensors(
    tensors: Sequence[tuple[str, Array]], allow_non_finite: bool
) -> np.dtype[Any]:
    """Names unique, one float dtype, finite unless allowed; returns the dtype."""
    first, dtype = tensors[0][0], np.dtype(tensors[0][1].dtype)
    if dtype not in STATE_DTYPES:
        raise InvalidArgument(
            f"group tensors must be float32 or float64, got {dtype} for {first!r}",
            reason="DTYPE_MISMATCH",
            metadata={"expected": "float32 or float64", "received": dtype},
            field="tensors[0].dtype",
        )
    seen: set[str] = set()
    for i, (tname, arr) in enumerate(tensors):
        check_name(tname, "tensor name")
        if tname in seen:
            raise InvalidArgument(
                f"tensor name {tname!r} appears twice", field=f"tensors[{i}].name"
            )
        seen.add(tname)
        if arr.dtype != dtype:
            raise InvalidArgument(
                f"a group has one dtype: {first!r} is {dtype}, "
                f"{tname!r} is {arr.dtype}",
                reason="DTYPE_MISMATCH",
                metadata={"expected": dtype, "received": arr.dtype},
                field=f"tensors[{i}].dtype",
            )
        if not allow_non_finite and not all_finite(arr):
            raise InvalidArgument(
                f"initial value of {tname!r} holds NaN or inf; pass "
                "allow_non_finite=True to keep it",
                field=f"tensors[{i}]",
            )
    return dtype


def check_state(
    attrs: OptimizerAttrs,
    tensors: Sequence[tuple[str, Array]],
    dtype: np.dtype[Any],
    state: Sequence[Array] | None,
    allow_non_finite: bool,
) -> None:
    """Either no state (zeros) or every V/H of every tensor, each shaped like X,
    finite unless allowed, and H (a sum of squares) never negative."""
    if not state:
        return
    n, names = len(tensors), attrs.state_names
    if len(state) != n * len(names):
        raise InvalidArgument(
            f"{attrs.op} state is {', '.join(names)} for each of the "
            f"{n} tensors: {n * len(names)} arrays, got {len(state)}"
        )
    for j, arr in enumerate(state):
        tname, x = tensors[j % n]
        sname = names[j // n]
        if arr.dtype != dtype or arr.shape != x.shape:
            raise InvalidArgument(
                f"state {sname} of {tname!r} must be {dtype} {x.shape}, got "
                f"{arr.dtype} {arr.shape}"
            )
        if not allow_non_finite and not all_finite(arr):
            raise InvalidArgument(
                f"state {sname} of {tname!r} holds NaN or inf; pass "
                "allow_non_finite=True to keep it"
            )
        if sname in attrs.non_negative_states and arr.size and bool((arr < 0).any()):
            raise InvalidArgument(
                f"state {sname} of {tname!r} holds negative values: {attrs.op}'s "
                f"{sname} accumulates squared gradients and must be >= 0"
            )


def check_tables(
    group: str,
    attrs: OptimizerAttrs,
    tensor_names: Sequence[str],
    dtype: np.dtype[Any],
    tables: Sequence[TableDefinition],
    table_arrays: Sequence[Sequence[Array]],
    allow_non_finite: bool,
) -> int:
    """Check a new group's ids tables (and the rows it resumes them with); returns
    the bytes their rows hold."""
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise InvalidArgument(f"a group's dtype is float32 or float64, got {dtype}")
    _check_table_definitions(group, tensor_names, tables)
    if not table_arrays:
        return 0
    _check_table_image(group, attrs, dtype, tables, table_arrays)
    return _check_table_rows(tables, table_arrays, allow_non_finite)


def _check_table_definitions(
    group: str, tensor_names: Sequence[str], tables: Sequence[TableDefinition]
) -> None:
    """Each table's name (unique among the group's tensors and tables), dim,
    max_rows and initializer."""
    seen = set(tensor_names)
    for t in tables:
        check_name(t.name, "ids table name")
        if t.name in seen:
            raise InvalidArgument(
                f"ids table name {t.name!r} is also a tensor or table of group "
                f"{group!r}; names are unique in a group"
            )
        seen.add(t.name)
        if t.dim < 1 or t.max_rows < 0:
            raise InvalidArgument(
                f"ids table {t.name!r} needs dim >= 1 and max_rows >= 0, got "
                f"dim={t.dim}, max_rows={t.max_rows}"
            )
        try:
            initializer_from_json(t.initializer)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"ids table {t.name!r}: bad initializer {dict(t.initializer)}: {exc}"
            ) from None


def _check_table_image(
    group: str,
    attrs: OptimizerAttrs,
    dtype: np.dtype[Any],
    tables: Sequence[TableDefinition],
    table_arrays: Sequence[Sequence[Array]],
) -> None:
    """The rows' arrays: per table ids, X rows and a row array per state, of the
    dtypes and shapes a group image holds."""
    per = 2 + len(attrs.state_names)
    if len(table_arrays) != len(tables) or any(len(a) != per for a in table_arrays):
        raise InvalidArgument(
            f"the rows of {len(tables)} ids tables are, per table, ids, X rows and "
            f"{'/'.join(attrs.state_names)} rows ({per} arrays)"
        )
    definition = GroupDefinition(
        group, attrs.op, {}, 0.0, 0, dtype, (), (), tables=tuple(tables)
    )
    try:
        GroupImage(definition, [a for arrays in table_arrays for a in arrays])
    except ImageFormatError as exc:
        raise InvalidArgument(str(exc)) from None


def _check_table_rows(
    tables: Sequence[TableDefinition],
    table_arrays: Sequence[Sequence[Array]],
    allow_non_finite: bool,
) -> int:
    """Each table's row count (at most max_rows) and values (finite unless
    allowed); returns the bytes the rows hold."""
    nbytes = 0
    for t, (ids, *rows) in zip(tables, table_arrays, strict=True):
        if t.max_rows and ids.size > t.max_rows:
            raise InvalidArgument(
                f"ids table {t.name!r} is given {ids.size} rows, over its "
                f"max_rows={t.max_rows}"
            )
        for r in rows:
            if not allow_non_finite and r.size and not bool(np.isfinite(r).all()):
                raise InvalidArgument(
                    f"the rows of ids table {t.name!r} hold NaN or inf; pass "
                    "allow_non_finite=True to keep them"
                )
        nbytes += sum(r.nbytes for r in rows)
    return nbytes
