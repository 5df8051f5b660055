"""The one-pass finiteness check of gradients (``kernels._finite``), on both kernel
paths: the same answer for every float class at every position, and the same
refusal of a push (status, reason, state unchanged)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnxps.server.errors import InvalidArgument
from onnxps.server.kernels import make_attrs
from onnxps.server.kernels._finite import FUSED_MIN_ELEMENTS, all_finite
from onnxps.server.kernels._select import fused_kernels
from onnxps.server.store import ParameterStore

PATHS = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(
    fused_kernels() is None, reason="numba is not installed"))]  # fmt: skip
BAD = [np.nan, -np.nan, np.inf, -np.inf]


@pytest.fixture(params=PATHS)
def path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ONNXPS_KERNELS", request.param)
    return str(request.param)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 7, FUSED_MIN_ELEMENTS, (1 << 18) + 5])
def test_finite_values_pass(path: str, dtype: Any, n: int) -> None:
    info = np.finfo(dtype)
    edge = np.array([0.0, -0.0, info.max, -info.max, info.tiny])
    edge = np.append(edge, info.smallest_subnormal)
    a = np.resize(edge.astype(dtype), n)
    assert all_finite(a) is True


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", [0, 1, 16383, 16384, 65535, -1])
def test_one_bad_element_anywhere_fails(
    path: str, dtype: Any, bad: float, where: int
) -> None:
    a = np.zeros(FUSED_MIN_ELEMENTS * 4 + 3, dtype)
    a[where] = bad
    assert all_finite(a) is False
    assert all_finite(a[:3]) is (where not in (0, 1))  # the small-array path


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layouts_and_read_only(path: str, dtype: Any) -> None:
    a = np.ones((512, 512), dtype)
    a.flags.writeable = False
    assert all_finite(a)
    b = np.ones((512, 512), dtype)
    b[100, 3] = np.nan
    assert not all_finite(b)
    assert not all_finite(b.T)  # not contiguous
    assert not all_finite(b[::2, ::1][50:, :])  # a strided view holding row 100
    assert all_finite(b[::3])  # rows 0, 3, ...: 100 is not among them
    swapped = b.astype(b.dtype.newbyteorder(">"))
    assert not all_finite(swapped)


@pytest.mark.parametrize("bad", BAD)
def test_push_refused_state_unchanged(path: str, bad: float) -> None:
    store = ParameterStore()
    n = FUSED_MIN_ELEMENTS * 2
    x0 = np.linspace(-1, 1, n, dtype=np.float32)
    store.create_group("g", make_attrs("Adam", {}), 0.1, [("w", x0)])
    g = np.full(n, 1e-3, np.float32)
    g[n // 2 + 1] = bad
    with pytest.raises(InvalidArgument) as err:
        store.push("g", [g])
    assert err.value.reason == "NON_FINITE_GRADIENT"
    assert "gradient 1 ('w') holds NaN or inf" in str(err.value)
    x, v, h = store.pull("g", with_state=True).arrays
    assert store.describe("g").update_count == 0
    assert np.array_equal(x, x0)
    assert not v.any() and not h.any()
