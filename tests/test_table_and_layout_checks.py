"""Every outcome of two branchy functions, pinned: ``check_tables`` (a new group's
ids tables and the rows it resumes them with) and ``layout_from_listing`` (a
group's layout from what the shards list). Both were split into smaller functions;
these tests held before the split and hold after it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from onnxps.client._cluster import (
    Layout,
    LayoutError,
    Part,
    Slot,
    layout_from_listing,
)
from onnxps.server.errors import InvalidArgument
from onnxps.server.kernels import make_attrs
from onnxps.server.store._checks import check_tables
from onnxps.wire.image import TableDefinition
from onnxps.wire.initializers import Zeros

Listing = list[tuple[int, str, Sequence[tuple[str, Sequence[int]]]]]

ADAGRAD = make_attrs("Adagrad", {"decay_factor": 0.1, "norm_coefficient": 0.01})
F32 = np.dtype(np.float32)
EMB = TableDefinition("emb", 2, Zeros().to_json(), max_rows=3)
IDS = np.array([1, 5], np.int64)
ROWS = np.ones((2, 2), np.float32)


def _check(
    tables: list[TableDefinition],
    arrays: list[list[Any]] | None = None,
    *,
    dtype: np.dtype[Any] = F32,
    allow_non_finite: bool = False,
) -> int:
    return check_tables(
        "g", ADAGRAD, ["b"], dtype, tables, arrays or [], allow_non_finite
    )


def test_check_tables_returns_the_bytes_of_the_rows() -> None:
    assert _check([EMB]) == 0  # a new table: no rows yet
    assert _check([EMB], [[IDS, ROWS, np.zeros((2, 2), np.float32)]]) == 32
    nan = ROWS.copy()
    nan[0, 1] = np.nan
    assert _check([EMB], [[IDS, nan, ROWS]], allow_non_finite=True) == 32


@pytest.mark.parametrize(
    ("tables", "dtype", "message"),
    [
        ([EMB], np.dtype(np.int32), "a group's dtype is float32 or float64, got int32"),
        (
            [TableDefinition("", 2, Zeros().to_json())],
            F32,
            "ids table name must be a non-empty string",
        ),
        (
            [TableDefinition("b", 2, Zeros().to_json())],
            F32,
            "ids table name 'b' is also a tensor or table of group 'g'; names are "
            "unique in a group",
        ),
        (
            [EMB, EMB],
            F32,
            "ids table name 'emb' is also a tensor or table of group 'g'; names are "
            "unique in a group",
        ),
        (
            [TableDefinition("emb", 0, Zeros().to_json())],
            F32,
            "ids table 'emb' needs dim >= 1 and max_rows >= 0, got dim=0, max_rows=0",
        ),
        (
            [TableDefinition("emb", 2, Zeros().to_json(), max_rows=-1)],
            F32,
            "ids table 'emb' needs dim >= 1 and max_rows >= 0, got dim=2, max_rows=-1",
        ),
    ],
)
def test_check_tables_refuses_a_definition(
    tables: list[TableDefinition], dtype: np.dtype[Any], message: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        _check(tables, dtype=dtype)
    assert str(info.value) == message


def test_check_tables_refuses_a_bad_initializer() -> None:
    bad = TableDefinition("emb", 2, {"kind": "no such"})
    with pytest.raises(InvalidArgument) as info:
        _check([bad])
    assert str(info.value).startswith(
        "ids table 'emb': bad initializer {'kind': 'no such'}: "
    )


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            [[IDS, ROWS]],
            "the rows of 1 ids tables are, per table, ids, X rows and H rows "
            "(3 arrays)",
        ),
        (
            [[IDS, ROWS, ROWS], [IDS, ROWS, ROWS]],
            "the rows of 1 ids tables are, per table, ids, X rows and H rows "
            "(3 arrays)",
        ),
        (
            [[np.array([5, 1], np.int64), ROWS, ROWS]],
            "group image of 'g': ids table 'emb' needs int64 ids (k,) ascending and "
            "unique, and float32 rows (k, 2); got int64 (2,) and "
            "[('float32', (2, 2)), ('float32', (2, 2))]",
        ),
        (
            [[IDS, ROWS.astype(np.float64), ROWS]],
            "group image of 'g': ids table 'emb' needs int64 ids (k,) ascending and "
            "unique, and float32 rows (k, 2); got int64 (2,) and "
            "[('float64', (2, 2)), ('float32', (2, 2))]",
        ),
        (
            [[np.arange(4, dtype=np.int64), np.ones((4, 2), np.float32), ROWS[:1]]],
            "group image of 'g': ids table 'emb' needs int64 ids (k,) ascending and "
            "unique, and float32 rows (k, 2); got int64 (4,) and "
            "[('float32', (4, 2)), ('float32', (1, 2))]",
        ),
        (
            [[np.arange(4, dtype=np.int64), *[np.ones((4, 2), np.float32)] * 2]],
            "ids table 'emb' is given 4 rows, over its max_rows=3",
        ),
        (
            [[IDS, ROWS, np.full((2, 2), np.inf, np.float32)]],
            "the rows of ids table 'emb' hold NaN or inf; pass allow_non_finite=True "
            "to keep them",
        ),
    ],
)
def test_check_tables_refuses_the_rows(arrays: list[list[Any]], message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        _check([EMB], arrays)
    assert str(info.value) == message


# -- layout_from_listing ---------------------------------------------------------------


def test_layout_of_a_group_not_listed_is_none() -> None:
    others = [(0, "h", [("t", (4,))]), (1, "h#p0of2", [("t@0-2@4", (2,))])]
    assert layout_from_listing("g", others) is None
    assert layout_from_listing("g", []) is None


def test_layout_of_a_whole_group_is_its_shard_and_tensors() -> None:
    listing: Listing = [
        (0, "h", [("x", (1,))]),
        (2, "g", [("a", (4,)), ("b", [2, 3])]),
    ]
    assert layout_from_listing("g", listing) == Layout(
        "g",
        ("a", "b"),
        ((4,), (2, 3)),
        (Part("g", 2, (Slot(0, 0, 4), Slot(1, 0, 6))),),
    )


def test_layout_of_a_split_group_joins_its_pieces() -> None:
    listing: Listing = [
        (1, "g#p1of2", [("t@5-8@8", (3,)), ("m@r0-2@2,3", (2, 3))]),
        (2, "g#p0of2", [("t@0-5@8", (5,))]),
        (0, "g#p0of2", [("t@0-5@8", (5,))]),  # a later listing of a part wins
    ]
    assert layout_from_listing("g", listing) == Layout(
        "g",
        ("t", "m"),
        ((8,), (2, 3)),
        (
            Part("g#p0of2", 0, (Slot(0, 0, 5),)),
            Part("g#p1of2", 1, (Slot(0, 5, 8), Slot(1, 0, 6, True))),
        ),
    )


@pytest.mark.parametrize(
    ("listing", "message"),
    [
        (
            [(0, "g", [("a", (4,))]), (1, "g", [("a", (4,))])],
            "group 'g' is held more than once in the cluster (2 whole, parts of "
            "counts [])",
        ),
        (
            [(0, "g", [("a", (4,))]), (1, "g#p1of2", [("a@2-4@4", (2,))])],
            "group 'g' is held more than once in the cluster (1 whole, parts of "
            "counts [2])",
        ),
        (
            [(0, "g#p0of2", [("a@0-2@4", (2,))]), (1, "g#p1of3", [])],
            "group 'g' is held more than once in the cluster (0 whole, parts of "
            "counts [2, 3])",
        ),
        (
            [(1, "g#p1of3", [("a@2-4@4", (2,))])],
            "group 'g' is split in 3 parts but parts [0, 2] are missing",
        ),
        (
            [(0, "g#p0of2", [("a@0-2@4", (2,))]), (1, "g#p1of2", [("a@2-x@4", ())])],
            "'a@2-x@4' is not a part's tensor name",
        ),
        (
            [(0, "g#p0of2", [("a@0-2@4", (2,))]), (1, "g#p1of2", [("a@r1-2@4", ())])],
            "'a@r1-2@4': rows of a tensor with fewer than 2 dims",
        ),
    ],
)
def test_layout_refuses_a_listing_that_is_not_one_group(
    listing: list[Any], message: str
) -> None:
    with pytest.raises(LayoutError) as info:
        layout_from_listing("g", listing)
    assert str(info.value) == message
