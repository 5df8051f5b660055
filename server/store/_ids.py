"""Tables keyed by arbitrary int64 ids: storage, lookups and their checks (no grpc).

A table's rows live in growable arrays ``x`` (and V, H as the operator keeps them)
of shape (capacity, dim), doubled when full (amortised O(1) per new row). Slots are
in creation order; a row never moves or goes away. The index is a sorted array of
ids with their slots (``np.searchsorted``: a vectorised lookup, O(log n) per id)
plus a dict of the ids created since it was last rebuilt (probed only for the ids
the sorted array misses); the sorted array is rebuilt (one argsort) when that dict
holds more than an eighth of the rows, so a new row costs amortised O(log n). The
same sorted order serves listing and saving. Cost per row: dim elements of X (and of
V, H) plus 24 bytes of index (id, sorted id, slot).

A new row's X is ``initial_rows`` of its id (``onnxps.wire.initializers``); its V
and H are zeros, the operator's initial state. A row push steps a table's rows as
``_sparse`` steps a fixed table's: gathered by slot, stepped, scattered back.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnxps.wire.image import TableDefinition
from onnxps.wire.initializers import (
    Initializer,
    initial_rows,
    initializer_from_json,
)

from ..errors import InvalidArgument
from ..kernels import OptimizerAttrs, Stepper
from ._sparse import INDEX_DTYPE, RowGradient, coalesce, step_rows

__all__ = [
    "IdsTable",
    "RowsPage",
    "check_ids",
    "check_table_spec",
    "empty_part",
    "new_row_counts",
    "table_part",
]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class RowsPage:
    """One page of an ids table's ids, ascending (``ParameterStore.list_rows``)."""

    ids: Array  # int64 (k,)
    rows: tuple[Array, ...]  # X rows (k, dim), then V, H rows; empty unless asked
    names: tuple[str, ...]  # the rows' names: table, "V:table", "H:table"
    next_after: int | None  # the last id of this page when more follow
    row_count: int  # rows the table holds
    update_count: int  # T of this page


class IdsTable:
    """One ids table's rows. Not thread-safe: its group's lock guards it."""

    def __init__(
        self,
        definition: TableDefinition,
        dtype: np.dtype[Any],
        state_names: Sequence[str],
    ) -> None:
        self.definition = definition
        self.name = definition.name
        self.dim = definition.dim
        self.max_rows = definition.max_rows
        self.initializer: Initializer = initializer_from_json(definition.initializer)
        self.dtype = dtype
        self.state_names = tuple(state_names)
        self.count = 0
        self._keys = np.empty(0, INDEX_DTYPE)  # sorted ids of the first _indexed rows
        self._order = np.empty(0, np.int64)  # their slots
        self._recent: dict[int, int] = {}  # ids created since, -> slot
        self._ids = np.empty(0, INDEX_DTYPE)
        self.x = np.empty((0, self.dim), dtype)
        self.states = {s: np.empty((0, self.dim), dtype) for s in self.state_names}

    @property
    def row_bytes(self) -> int:
        """Bytes one row holds: X, V, H."""
        return self.dim * self.dtype.itemsize * (1 + len(self.state_names))

    @property
    def state_bytes(self) -> int:
        return self.count * self.row_bytes

    # -- lookups -------------------------------------------------------------------
    def lookup(self, ids: Array) -> Array:
        """The slot of each id, -1 for an id the table does not hold."""
        keys = self._keys
        pos = np.searchsorted(keys, ids)
        if keys.size:
            np.minimum(pos, keys.size - 1, out=pos)
            slots = np.where(keys[pos] == ids, self._order[pos], -1)
        else:
            slots = np.full(ids.size, -1, np.int64)
        if self._recent:
            miss = np.flatnonzero(slots < 0)
            get = self._recent.get
            found = map(get, ids[miss].tolist(), itertools.repeat(-1))
            slots[miss] = np.fromiter(found, np.int64, count=miss.size)
        return slots

    def missing(self, unique_ids: Array) -> Array:
        """The ids (of unique ones) the table does not hold yet, in order."""
        return unique_ids[self.lookup(unique_ids) < 0]

    def sorted_slots(self) -> Array:
        """Every row's slot, by ascending id."""
        if self._recent:
            self._reindex()
        return self._order

    def _reindex(self) -> None:
        self._order = np.argsort(self._ids[: self.count], kind="stable")
        self._keys = self._ids[self._order]
        self._recent = {}

    # -- changes -------------------------------------------------------------------
    def ensure(self, unique_ids: Array) -> Array:
        """The slots of ``unique_ids``, creating the rows of new ones."""
        slots = self.lookup(unique_ids)
        new = slots < 0
        if new.any():
            ids = unique_ids[new]
            slots[new] = self._append(ids, None)
        return slots

    def _append(self, ids: Array, values: Sequence[Array] | None) -> Array:
        """New rows for ``ids`` (not held yet): X, V, H as given, else initial."""
        k = ids.size
        self._grow(self.count + k)
        slots = np.arange(self.count, self.count + k, dtype=np.int64)
        self._ids[self.count : self.count + k] = ids
        if values is None:
            self.x[slots] = initial_rows(
                self.initializer, self.name, ids, self.dim, self.dtype
            )
            for s in self.state_names:
                self.states[s][slots] = 0
        else:
            self.x[slots] = values[0]
            for s, v in zip(self.state_names, values[1:], strict=True):
                self.states[s][slots] = v
        self.count += k
        self._recent.update(zip(ids.tolist(), slots.tolist(), strict=True))
        if len(self._recent) > max(1024, self.count // 8):
            self._reindex()
        return slots

    def _grow(self, need: int) -> None:
        cap = self.x.shape[0]
        if need <= cap:
            return
        cap = max(need, 2 * cap, 16)

        def grown(a: Array) -> Array:
            out = np.zeros((cap, *a.shape[1:]), a.dtype)
            out[: self.count] = a[: self.count]
            return out

        self._ids = grown(self._ids)
        self.x = grown(self.x)
        self.states = {s: grown(a) for s, a in self.states.items()}

    def load(self, ids: Array, rows: Sequence[Array]) -> None:
        """Rows restored from an image (ids unique, not held yet): X, V, H."""
        self._append(np.asarray(ids, INDEX_DTYPE), rows)

    def step(
        self,
        attrs: OptimizerAttrs,
        r: float,
        t: int,
        part: RowGradient,
        cache: dict[int, Stepper],
    ) -> None:
        """Step the rows of a coalesced gradient, creating new ones first."""
        if part.indices.size == 0:
            return
        slots = self.ensure(part.indices)
        cap = self.x.shape[0]
        step_rows(
            attrs, r, t,
            [self.x.reshape(-1)],
            [(cap, self.dim)],
            {s: [a.reshape(-1)] for s, a in self.states.items()},
            [RowGradient(slots, part.values)],
            cache,
        )  # fmt: skip

    # -- reads ---------------------------------------------------------------------
    def read(self, ids: Array, with_state: bool) -> list[Array]:
        """Copies of the X rows of ``ids`` (repeats allowed), then V, H rows when
        ``with_state``; an id the table does not hold reads as its initial row
        (V, H zeros) without being created."""
        slots = self.lookup(ids)
        held = slots >= 0
        out = [self.x[np.where(held, slots, 0)] if self.count else None]
        out += [a[np.where(held, slots, 0)] if self.count else None
                for s, a in self.states.items() if with_state]  # fmt: skip
        result: list[Array] = []
        for j, a in enumerate(out):
            if a is None:
                a = np.zeros((ids.size, self.dim), self.dtype)
            if not held.all():
                miss = ~held
                if j == 0:
                    a[miss] = initial_rows(
                        self.initializer, self.name, ids[miss], self.dim, self.dtype
                    )
                else:
                    a[miss] = 0
            result.append(a)
        return result

    def page(
        self, after: int | None, limit: int, with_values: bool, with_state: bool
    ) -> tuple[Array, list[Array], int | None]:
        """Up to ``limit`` ids above ``after`` ascending, their rows when asked, and
        the last id when more follow (else None)."""
        order = self.sorted_slots()
        ids = self._ids[order]
        start = 0 if after is None else int(np.searchsorted(ids, after, "right"))
        stop = min(ids.size, start + limit)
        slots = order[start:stop]
        page_ids = ids[start:stop].copy()
        rows: list[Array] = []
        if with_values:
            rows.append(self.x[slots])
            if with_state:
                rows += [self.states[s][slots] for s in self.state_names]
        more = stop < ids.size
        return page_ids, rows, int(page_ids[-1]) if more and stop > start else None

    def arrays(self) -> list[Array]:
        """The table's image: ids ascending, X rows, V rows, H rows (copies)."""
        order = self.sorted_slots()
        return [self._ids[order].copy(), self.x[order]] + [
            self.states[s][order] for s in self.state_names
        ]


def check_ids(ids: Array, what: str, group: str) -> Array:
    """int64 ids of shape (k,) (any values); INVALID_ARGUMENT otherwise."""
    idx = np.asarray(ids)
    if idx.dtype != INDEX_DTYPE or idx.ndim != 1:
        raise InvalidArgument(
            f"{what}: ids must be int64 of shape (k,), got {idx.dtype} {idx.shape}",
            reason="ROW_INDICES",
            field=what,
            metadata={"group": group},
        )
    return idx


def check_table_spec(
    group: str,
    table: IdsTable,
    where: str,
    index_spec: tuple[np.dtype[Any], tuple[int, ...]] | None,
    value_spec: tuple[np.dtype[Any], tuple[int, ...]],
) -> None:
    """Check one gradient of an ids table from its header (before any bytes)."""
    if index_spec is None:
        raise InvalidArgument(
            f"{table.name!r} is an ids table: its gradient is (ids, rows), not a "
            "dense gradient",
            reason="ROW_INDICES",
            field=f"{where}.indices",
            metadata={"group": group, "tensor": table.name},
        )
    idtype, ishape = index_spec
    if np.dtype(idtype) != INDEX_DTYPE or len(ishape) != 1:
        raise InvalidArgument(
            f"ids of table {table.name!r} must be int64 of shape (k,), got "
            f"{np.dtype(idtype)} {tuple(ishape)}",
            reason="ROW_INDICES",
            field=f"{where}.indices",
            metadata={"group": group, "tensor": table.name},
        )
    vdtype, vshape = value_spec
    if np.dtype(vdtype) != table.dtype:
        raise InvalidArgument(
            f"gradient of {table.name!r} must be {table.dtype}, the group's dtype; "
            f"got {np.dtype(vdtype)}",
            reason="DTYPE_MISMATCH",
            field=f"{where}.values.dtype",
            metadata={"group": group, "expected": table.dtype, "received": vdtype},
        )
    expected = (int(ishape[0]), table.dim)
    if tuple(vshape) != expected:
        raise InvalidArgument(
            f"gradient of ids table {table.name!r} must have shape {expected} (one "
            f"row of {table.dim} per id), got {tuple(vshape)}",
            reason="SHAPE_MISMATCH",
            field=f"{where}.values.dims",
            metadata={"group": group, "expected": expected, "received": vshape},
        )


def table_part(
    group: str, table: IdsTable, where: str, ids: Any, values: Any
) -> RowGradient:
    """One table's gradient checked and coalesced (ids ascending and unique, the
    rows of a repeated id summed left to right)."""
    ids, values = np.asarray(ids), np.asarray(values)
    check_table_spec(
        group, table, where, (ids.dtype, ids.shape), (values.dtype, values.shape)
    )
    return coalesce(check_ids(ids, f"{where}.indices", group), values)


def empty_part(table: IdsTable) -> RowGradient:
    return RowGradient(np.empty(0, INDEX_DTYPE), np.empty((0, table.dim), table.dtype))


def new_row_counts(
    tables: Mapping[str, IdsTable], pushes: Sequence[Sequence[RowGradient]]
) -> dict[str, int]:
    """Per table: how many distinct ids of these pushes' parts it does not hold."""
    out: dict[str, int] = {}
    for j, (name, table) in enumerate(tables.items()):
        ids = [p[j].indices for p in pushes if p[j].indices.size]
        if not ids:
            out[name] = 0
            continue
        unique = np.unique(np.concatenate(ids)) if len(ids) > 1 else ids[0]
        out[name] = int(table.missing(unique).size)
    return out
