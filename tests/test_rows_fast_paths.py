"""The fast paths of a row push against their references, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnxps.server.store._sparse import _stable_order, coalesce


@pytest.mark.parametrize(
    "top", [10, 1_000_000, (1 << 62) // 4096 - 1, (1 << 62) // 4096, 2**63 - 1]
)
def test_stable_order_is_a_stable_argsort(top: int) -> None:
    rng = np.random.default_rng(top % 1000)
    idx = rng.integers(0, top, 4096, dtype=np.int64, endpoint=True)
    idx[::7] = idx[0]  # repeats, whose positions must stay in push order
    idx[-1] = top  # the largest index: the keys fit in int64, or the fallback
    order, s_idx = _stable_order(idx)
    want = np.argsort(idx, kind="stable")
    np.testing.assert_array_equal(order, want, strict=True)
    np.testing.assert_array_equal(s_idx, idx[want], strict=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_coalesce_sums_repeats_left_to_right_in_push_order(dtype: Any) -> None:
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 50, 400)
    values = (
        rng.standard_normal((400, 5)) * 10.0 ** rng.integers(-8, 8, (400, 1))
    ).astype(dtype)
    got = coalesce(idx, values)
    uniq = np.unique(idx)
    np.testing.assert_array_equal(got.indices, uniq, strict=True)
    for u, row in zip(uniq, got.values, strict=True):
        where = np.flatnonzero(idx == u)
        acc = values[where[0]].copy()
        for w in where[1:]:
            acc += values[w]
        np.testing.assert_array_equal(row, acc, strict=True)
