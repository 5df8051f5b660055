"""Row pushes and row reads (``_sparse``, and the ids tables of ``_ids``).

A row push is one step in which only the given rows change: each tensor's gradient
is (indices, rows) or dense, and each ids table's is (ids, rows); the push is then
flattened into one list of arrays and runs the ordinary push pipeline (``_push``).
A row pull reads rows of one version, and a page lists an ids table's ids. The
functions here check against a group's definition; the ``*_locked`` ones run under
the group's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgument, ResourceExhausted
from ..kernels._finite import all_finite
from ._checks import check_learning_rate
from ._group import Group, PullResult, StoreLimits, is_row_push
from ._ids import (
    IdsTable,
    RowsPage,
    check_ids,
    check_table_spec,
    empty_part,
    new_row_counts,
    table_part,
)
from ._sparse import (
    INDEX_DTYPE,
    RowSpec,
    check_indices,
    check_row_specs,
    flatten,
    gather_rows,
    row_push_parts,
    split_row_push,
)

__all__ = [
    "Selection",
    "check_logged_row_push",
    "check_row_push_specs",
    "check_row_values",
    "check_selections",
    "check_table_room",
    "read_rows_locked",
    "row_push_arrays",
    "rows_page_locked",
]

Array = np.ndarray[Any, Any]
# A checked selection of a row pull: (tensor or table name, tensor index or -1 for
# an ids table, indices)
Selection = tuple[str, int, Array]


def check_row_push_specs(g: Group, specs: Iterable[RowSpec]) -> None:
    """Check a row push's header (tensor names, dtypes, shapes)."""
    specs = list(specs)
    dense = [s for s in specs if s[0] not in g.tables]
    check_row_specs(g.name, g.names, g.shapes, g.dtype, dense)
    seen: set[str] = set()
    for j, (tname, index_spec, value_spec) in enumerate(specs):
        if tname in g.tables:
            _check_table_once(g, tname, seen, f"gradients[{j}]")
            where = f"gradients[{j}]"
            check_table_spec(g.name, g.tables[tname], where, index_spec, value_spec)


def _check_table_once(g: Group, tname: str, seen: set[str], where: str) -> None:
    if tname in seen:
        raise InvalidArgument(
            f"ids table {tname!r} is named twice in one row push; put its rows "
            "in one gradient (repeated ids are summed)",
            reason="DUPLICATE_TENSOR",
            field=f"{where}.name",
            metadata={"group": g.name, "tensor": tname},
        )
    seen.add(tname)


def row_push_arrays(
    g: Group, gradients: dict[str, Array | tuple[Array, Array]]
) -> list[Array]:
    """A row push's gradients, checked and coalesced, as the flat arrays it is
    logged and stepped as (a part per tensor, then one per ids table)."""
    dense = {k: v for k, v in gradients.items() if k not in g.tables}
    parts = row_push_parts(g.name, g.names, g.shapes, g.dtype, dense)
    where = {k: f"gradients[{j}]" for j, k in enumerate(gradients)}
    for tname, table in g.tables.items():
        grad = gradients.get(tname)
        if grad is None:
            parts.append(empty_part(table))
            continue
        if not isinstance(grad, tuple):
            raise InvalidArgument(
                f"{tname!r} is an ids table: its gradient is (ids, rows), not a "
                "dense gradient",
                reason="ROW_INDICES",
                field=f"{where[tname]}.indices",
                metadata={"group": g.name, "tensor": tname},
            )
        parts.append(table_part(g.name, table, where[tname], grad[0], grad[1]))
    return flatten(parts)


def check_row_values(
    g: Group, flat: Sequence[Array], learning_rate: float | None
) -> None:
    if learning_rate is not None:
        check_learning_rate(learning_rate, g.dtype, "the push's learning_rate")
    if g.allow_non_finite:
        return
    for a in flat:
        if a.dtype != INDEX_DTYPE and not all_finite(a):
            raise InvalidArgument(
                f"a row gradient holds NaN or inf, which would poison group "
                f"{g.name!r} for good; fix the worker, or create the group with "
                "allow_non_finite=True",
                reason="NON_FINITE_GRADIENT",
                field="gradients",
                metadata={"group": g.name},
            )


def check_logged_row_push(g: Group, arrays: Sequence[Array]) -> None:
    """A logged row push fits the group (its rows are coalesced and checked)."""
    parts = split_row_push(arrays)
    if len(parts) != len(g.names) + len(g.tables):
        raise InvalidArgument(
            f"logged row push has {len(parts)} tensors, group {g.name!r} has "
            f"{len(g.names)} and {len(g.tables)} ids tables"
        )
    for i, p in enumerate(parts[: len(g.names)]):
        if isinstance(p, np.ndarray):
            continue
        check_indices(p.indices, g.shapes[i][0], f"tensor {g.names[i]!r}", g.name)


def check_selections(g: Group, selections: dict[str, Array]) -> list[Selection]:
    """A row pull's selections, checked against the group's tensors and tables."""
    checked: list[Selection] = []
    for j, (tname, idx) in enumerate(selections.items()):
        where = f"tensors[{j}].indices"
        if tname in g.tables:
            checked.append((tname, -1, check_ids(idx, where, g.name)))
            continue
        if tname not in g.names:
            held = [*g.names, *g.tables]
            raise InvalidArgument(
                f"group {g.name!r} has no tensor {tname!r}; it holds {', '.join(held)}",
                reason="UNKNOWN_TENSOR",
                field=f"tensors[{j}].name",
                metadata={"group": g.name, "tensor": tname},
            )
        i = g.names.index(tname)
        if not g.shapes[i]:
            raise InvalidArgument(
                f"tensor {tname!r} is a scalar: it has no rows",
                reason="NOT_A_TABLE",
                field=where,
            )
        checked.append((tname, i, check_indices(idx, g.shapes[i][0], where, g.name)))
    return checked


def read_rows_locked(
    g: Group,
    checked: Sequence[Selection],
    with_state: bool,
    reserve: Callable[[int], None] | None,
) -> PullResult:
    """Copies of the selected rows: X rows per selection in order, then (with
    state) V rows and H rows. ``reserve(nbytes)`` may refuse first by raising."""
    states = g.attrs.state_names if with_state else ()
    if reserve is not None:
        row_bytes = sum(idx.size * _row_elements(g, t, i) for t, i, idx in checked)
        reserve(row_bytes * g.dtype.itemsize * (1 + len(states)))
    per_selection = [
        g.tables[t].read(idx, with_state)
        if i < 0
        else [
            gather_rows(src[i], g.shapes[i], idx)
            for src in [g.xs] + [g.states[s] for s in states]
        ]
        for t, i, idx in checked
    ]
    arrays = tuple(rows[k] for k in range(1 + len(states)) for rows in per_selection)
    names = tuple(
        (f"{s}:" if s else "") + t for s in ("", *states) for t, _, _ in checked
    )
    return PullResult(g.update_count, g.learning_rate, arrays, names)


def _row_elements(g: Group, table: str, i: int) -> int:
    if i < 0:
        return g.tables[table].dim
    return g.xs[i].size // max(1, g.shapes[i][0])


def rows_page_locked(
    g: Group,
    table: str,
    after: int | None,
    limit: int,
    with_values: bool,
    with_state: bool,
) -> RowsPage:
    """A page of an ids table's ids ascending, above ``after``, at most ``limit``
    (0: all); with their X rows (and V, H rows)."""
    t = _table(g, table)
    page, rows, last = t.page(after, limit or max(1, t.count), with_values, with_state)
    states = t.state_names if with_state else ()
    names = (table, *(f"{s}:{table}" for s in states)) if with_values else ()
    return RowsPage(page, tuple(rows), names, last, t.count, g.update_count)


def _table(g: Group, table: str) -> IdsTable:
    t = g.tables.get(table)
    if t is None:
        held = ", ".join(g.tables) or "none"
        raise InvalidArgument(
            f"group {g.name!r} has no ids table {table!r}; its ids tables: {held}",
            reason="UNKNOWN_TENSOR",
            field="table",
            metadata={"group": g.name, "tensor": table},
        )
    return t


def check_table_room(
    g: Group,
    grads: Sequence[Array],
    limits: StoreLimits,
    others: Callable[[], list[Group]],
) -> None:
    """Under the lock, before a row push is logged: the rows it (and, in a sync
    group, the step it joins) would create fit the tables' max_rows and the
    server's byte limits; RESOURCE_EXHAUSTED otherwise, nothing changed.
    ``others()`` gives the server's other groups."""
    any_limit = limits.max_group_bytes or limits.max_total_bytes
    if not is_row_push(grads) or not (
        any_limit or any(t.max_rows for t in g.tables.values())
    ):
        return  # nothing to count against
    new_bytes = _new_row_bytes(g, grads)
    if not new_bytes:
        return
    limit = limits.max_group_bytes
    if limit and g.state_bytes + new_bytes > limit:
        raise ResourceExhausted(
            f"the push would grow group {g.name!r} by {new_bytes} bytes of new "
            f"rows to {g.state_bytes + new_bytes}, over the server's limit of "
            f"{limit} bytes per group; nothing was changed",
            metadata={"limit": "max_group_bytes", "group": g.name},
        )
    limit = limits.max_total_bytes
    if limit:
        # other groups' sizes read without their locks: a moment's estimate
        total = sum(o.state_bytes for o in others()) + g.state_bytes + new_bytes
        if total > limit:
            raise ResourceExhausted(
                f"the push would grow group {g.name!r} by {new_bytes} bytes of "
                f"new rows; the server would hold {total}, over its limit of "
                f"{limit}; nothing was changed",
                metadata={"limit": "max_total_bytes", "group": g.name},
            )


def _new_row_bytes(g: Group, grads: Sequence[Array]) -> int:
    """The bytes of the rows the push (with the sync step it joins) would create;
    RESOURCE_EXHAUSTED when they are over a table's max_rows."""
    n = len(g.names)
    mine = split_row_push(grads)[n:]
    pushes = [split_row_push(c)[n:] for c in g.pending.values()] + [mine]
    new = new_row_counts(g.tables, pushes)  # type: ignore[arg-type]
    new_bytes = 0
    for tname, k in new.items():
        t = g.tables[tname]
        if t.max_rows and t.count + k > t.max_rows:
            raise ResourceExhausted(
                f"the push would create {k} rows in ids table {tname!r} of group "
                f"{g.name!r}, which holds {t.count} of its max_rows={t.max_rows}; "
                "nothing was changed",
                metadata={"limit": "max_rows", "group": g.name, "table": tname},
            )
        new_bytes += k * t.row_bytes
    return new_bytes
