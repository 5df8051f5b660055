"""The fused numba path against the NumPy path, bit for bit, and how a path is chosen.

The conformance, fast-path and validation suites run on both paths already (see
``kernel_paths``); here the two paths meet on values chosen to break a reordering:
subnormals, signed zeros, huge and tiny magnitudes, inf and NaN.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kernel_paths import HAVE_NUMBA, NO_NUMBA
from onnxps.server.kernels import KERNEL_PATHS, Stepper, kernel_path, make_attrs

Array = np.ndarray[Any, Any]

needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason=NO_NUMBA)

# Every attribute away from its default somewhere, and both Momentum modes.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "adagrad": ("Adagrad", {}),
    "adagrad-all": (
        "Adagrad",
        {"decay_factor": 0.25, "norm_coefficient": 0.01, "epsilon": 1e-5},
    ),
    "momentum": (
        "Momentum",
        {"alpha": 0.9, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.0},
    ),
    "momentum-l2": (
        "Momentum",
        {"alpha": 0.95, "beta": 0.85, "mode": "standard", "norm_coefficient": 0.01},
    ),
    "nesterov": (
        "Momentum",
        {"alpha": 0.9, "beta": 1.0, "mode": "nesterov", "norm_coefficient": 0.0},
    ),
    "nesterov-l2": (
        "Momentum",
        {"alpha": 0.8, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.02},
    ),
    "adam": ("Adam", {}),
    "adam-l2": ("Adam", {"norm_coefficient": 0.01}),
    "adam-post": ("Adam", {"norm_coefficient_post": 0.01}),
    "adam-all": (
        "Adam",
        {
            "alpha": 0.8,
            "beta": 0.95,
            "epsilon": 1e-7,
            "norm_coefficient": 0.001,
            "norm_coefficient_post": 0.02,
        },
    ),
    "adam-eps0": ("Adam", {"epsilon": 0.0}),
}
STATES = {"Adagrad": ("H",), "Momentum": ("V",), "Adam": ("V", "H")}
UINT: dict[int, type[np.unsignedinteger[Any]]] = {4: np.uint32, 8: np.uint64}


def wild(rng: np.random.Generator, n: int, dtype: Any, finite: bool) -> Array:
    """Values that break a reordering: random bit patterns, subnormals, +-0, huge."""
    fi = np.finfo(dtype)
    uint = UINT[fi.dtype.itemsize]
    kind = rng.integers(0, 8, n)
    out = np.empty(n, dtype)
    draws: dict[int, Callable[[int], Any]] = {
        0: lambda m: rng.standard_normal(m),
        # every exponent, NaNs among them
        1: lambda m: rng.integers(0, np.iinfo(uint).max, m, uint, True).view(dtype),
        2: lambda m: np.zeros(m),
        3: lambda m: np.full(m, -0.0),
        4: lambda m: rng.uniform(-1, 1, m) * float(fi.smallest_normal),  # subnormal
        5: lambda m: rng.uniform(-1, 1, m) * float(fi.max),
        6: lambda m: rng.standard_normal(m) * 1e-30,
        7: lambda m: rng.choice([-np.inf, np.inf], m),
    }
    for k, draw in draws.items():
        where = kind == k
        out[where] = draw(int(np.count_nonzero(where)))
    if finite:
        out[~np.isfinite(out)] = dtype(1.5)
    return out


def group(op: str, n: int, dtype: Any, seed: int, finite: bool) -> list[Array]:
    rng = np.random.default_rng(seed)
    return [wild(rng, n, dtype, finite) for _ in range(2 + len(STATES[op]))]


def step(
    path: str, op: str, attrs: dict[str, Any], arrays: list[Array], t: int, **kw: Any
) -> list[Array]:
    """X, V, H after one step of ``path`` on copies; G passed read-only, as decoded."""
    x, g, *states = (np.copy(a) for a in arrays)
    g.flags.writeable = False
    by_name = dict(zip(STATES[op], states, strict=True))
    v, h = by_name.get("V"), by_name.get("H")
    stepper = Stepper(make_attrs(op, attrs), x.dtype, [x.size], kernels=path, **kw)
    stepper.step(
        0.01, t, [x], [g], None if v is None else [v], None if h is None else [h]
    )
    return [x, *states]


def assert_same_bits(got: list[Array], expected: list[Array]) -> None:
    for a, b in zip(got, expected, strict=True):
        uint = UINT[a.dtype.itemsize]
        assert a.dtype == b.dtype
        assert np.array_equal(a.view(uint), b.view(uint)), np.sum(a != b)


def assert_same_bits_but_nan_payloads(got: list[Array], expected: list[Array]) -> None:
    """Bit for bit except which NaN a NaN result carries where two NaNs met.

    IEEE 754 leaves open which operand's payload ``NaN + NaN`` keeps, and LLVM may
    swap the operands of a commutative operation.
    """
    for a, b in zip(got, expected, strict=True):
        nan = np.isnan(b)
        assert np.array_equal(np.isnan(a), nan)
        uint = UINT[a.dtype.itemsize]
        assert np.array_equal(a[~nan].view(uint), b[~nan].view(uint))


N = 1 << 20


@pytest.mark.slow
@needs_numba
@pytest.mark.parametrize("t", [0, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_fused_equals_numpy_on_a_million_wild_finite_values(
    config: str, dtype: Any, t: int
) -> None:
    op, attrs = CONFIGS[config]
    arrays = group(op, N, dtype, seed=t, finite=True)
    fused = step("numba", op, attrs, arrays, t)
    assert_same_bits(fused, step("numpy", op, attrs, arrays, t))
    assert not np.array_equal(fused[0], arrays[0])


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_fused_equals_numpy_with_inf_and_nan_inputs(config: str, dtype: Any) -> None:
    op, attrs = CONFIGS[config]
    arrays = group(op, N // 4, dtype, seed=11, finite=False)
    assert np.isnan(arrays[0]).any() and np.isinf(arrays[1]).any()
    fused = step("numba", op, attrs, arrays, 3)
    assert_same_bits_but_nan_payloads(fused, step("numpy", op, attrs, arrays, 3))


def test_wild_values_tell_every_grouping_apart() -> None:
    """The comparisons above would catch a regrouping, a widening or an FMA.

    Adagrad's ``x - r * g / d`` three ways on the same values: as the kernels group
    it, regrouped, and in float64 rounded once (what an FMA or a float32 op
    promoted to float64 does).
    """
    x, g, d = group("Momentum", N, np.float32, seed=5, finite=True)
    d = np.abs(d) + np.float32(1e-3)
    r = np.float32(0.01)
    with np.errstate(all="ignore"):
        kernels = x - g * r / d
        regrouped = x - g * (r / d)
        wide = (x.astype(np.float64) - g.astype(np.float64) * 0.01 / d).astype(
            np.float32
        )
    assert np.sum(kernels != regrouped) > 1000
    assert np.sum(kernels != wide) > 1000


@needs_numba
@settings(max_examples=200, deadline=None)
@given(
    config=st.sampled_from(list(CONFIGS)),
    dtype=st.sampled_from([np.float32, np.float64]),
    t=st.integers(0, 12) | st.integers(0, 2**40),
    data=st.data(),
)
def test_fused_equals_numpy_on_any_floats(
    config: str, dtype: Any, t: int, data: st.DataObject
) -> None:
    op, attrs = CONFIGS[config]
    n = data.draw(st.integers(0, 40))
    width: Literal[32, 64] = 32 if dtype == np.float32 else 64
    elements = st.floats(allow_nan=True, allow_infinity=True, width=width)
    arrays = [
        data.draw(hnp.arrays(dtype, n, elements=elements))
        for _ in range(2 + len(STATES[op]))
    ]
    fused = step("numba", op, attrs, arrays, t)
    assert_same_bits_but_nan_payloads(fused, step("numpy", op, attrs, arrays, t))


@needs_numba
def test_read_only_gradient_takes_the_compiled_kernel() -> None:
    """A gradient decoded from the wire is read-only: compiled for, no fallback."""
    arrays = group("Adam", 1000, np.float32, seed=1, finite=True)
    x, g, v, h = (np.copy(a) for a in arrays)
    g.flags.writeable = False
    stepper = Stepper(make_attrs("Adam", {}), np.float32, [1000], kernels="numba")
    stepper.step(0.01, 1, [x], [g], [v], [h])
    assert stepper._scratch == [None]  # the NumPy fallback was never needed
    assert_same_bits([x, v, h], step("numpy", "Adam", {}, arrays, 1))


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_strided_gradient_falls_back_to_numpy_blocks(dtype: Any) -> None:
    op, attrs = CONFIGS["adam-all"]
    arrays = group(op, 5000, dtype, seed=2, finite=True)
    x, _, v, h = (np.copy(a) for a in arrays)
    strided = np.repeat(arrays[1], 2)[::2]
    assert not strided.flags.c_contiguous
    stepper = Stepper(make_attrs(op, attrs), dtype, [5000], block=1024, kernels="numba")
    stepper.step(0.01, 1, [x], [strided], [v], [h])
    assert stepper._scratch[0] is not None
    assert_same_bits([x, v, h], step("numpy", op, attrs, arrays, 1))


def step_rows(
    path: str, op: str, attrs: dict[str, Any], arrays: list[Array], t: int
) -> tuple[list[Array], bool]:
    """X, V, H of (rows, 24) tables after a row step of ``path`` on copies: the
    fused row kernel, or (numpy) gather, ``step`` and scatter; and whether the
    fused kernel ran."""
    rows, width = 500, 24
    x, g, *states = (np.copy(a[: rows * width]) for a in arrays)
    by_name = dict(zip(STATES[op], states, strict=True))
    v, h = by_name.get("V"), by_name.get("H")
    idx = np.unique(np.random.default_rng(t).integers(0, rows, 300))
    rows_g = g[: idx.size * width]
    rows_g.flags.writeable = False
    stepper = Stepper(make_attrs(op, attrs), x.dtype, [0], kernels=path)
    fused = stepper.step_rows(0.01, t, x, rows_g, v, h, idx, width)
    if not fused:
        table = [a.reshape(rows, width) for a in (x, v, h) if a is not None]
        got = [a[idx].reshape(-1) for a in table]
        xr, *sr = got
        sv = dict(zip(STATES[op], sr, strict=True))
        dense = Stepper(make_attrs(op, attrs), x.dtype, [xr.size], kernels=path)
        vr, hr = sv.get("V"), sv.get("H")
        dense.step(
            0.01, t, [xr], [rows_g], None if vr is None else [vr],
            None if hr is None else [hr],
        )  # fmt: skip
        for a, b in zip(table, got, strict=True):
            a[idx] = b.reshape(-1, width)
    return [x, *states], fused


@needs_numba
@pytest.mark.parametrize("t", [0, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_fused_row_kernel_equals_gather_step_scatter(
    config: str, dtype: Any, t: int
) -> None:
    """A row push's one-pass kernel against the NumPy path on gathered rows."""
    op, attrs = CONFIGS[config]
    arrays = group(op, 12000, dtype, seed=t + 1, finite=True)
    fused, took = step_rows("numba", op, attrs, arrays, t)
    reference, numpy_took = step_rows("numpy", op, attrs, arrays, t)
    assert took and not numpy_took
    assert_same_bits(fused, reference)
    touched = np.unique(np.random.default_rng(t).integers(0, 500, 300))
    x0 = arrays[0][: 500 * 24].reshape(500, 24)
    assert not np.array_equal(fused[0].reshape(500, 24)[touched], x0[touched])
    untouched = np.setdiff1d(np.arange(500), touched)
    for got, before in zip(fused, [arrays[0], *arrays[2:]], strict=True):
        was = before[: 500 * 24].reshape(500, 24)[untouched]
        assert_same_bits([got.reshape(500, 24)[untouched]], [was])


# -- choosing the path ---------------------------------------------------------------


def test_kernel_paths() -> None:
    assert KERNEL_PATHS == ("numpy", "numba")
    assert kernel_path("numpy") == "numpy"
    assert kernel_path("auto") == ("numba" if HAVE_NUMBA else "numpy")
    assert kernel_path(" NumPy ") == "numpy"


def test_unknown_kernel_path_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^kernels='cuda' is not a kernel path: expected one of auto, numpy, "
        "numba$",
    ):
        Stepper(make_attrs("Adam", {}), np.float32, [1], kernels="cuda")


def test_unknown_env_kernel_path_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXPS_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"^ONNXPS_KERNELS='fast' is not a kernel"):
        kernel_path()


@pytest.mark.parametrize("value", ["numpy", "", "auto"])
def test_env_chooses_the_default_path(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ONNXPS_KERNELS", value)
    expected = "numba" if HAVE_NUMBA and value != "numpy" else "numpy"
    assert Stepper(make_attrs("Adagrad", {}), np.float32, [1]).kernels == expected


def run_python(code: str, kernels: str | None, hide_numba: bool) -> str:
    """``code`` in a fresh interpreter; numba unimportable there if ``hide_numba``."""
    prelude = "import sys\nsys.modules['numba'] = None\n" if hide_numba else ""
    env = {k: v for k, v in os.environ.items() if k != "ONNXPS_KERNELS"}
    if kernels is not None:
        env["ONNXPS_KERNELS"] = kernels
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


TWO_STEPPERS = """
    import logging
    import numpy as np
    from onnxps.server.kernels import Stepper, make_attrs

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for _ in range(2):
        stepper = Stepper(make_attrs("Adam", {}), np.float32, [4])
        x = np.ones(4, np.float32)
        stepper.step(0.1, 0, [x], [x.copy()], [x.copy()], [x.copy()])
    print("path", stepper.kernels, x[0])
"""


def test_without_numba_auto_takes_numpy_and_says_so_once() -> None:
    out = run_python(TWO_STEPPERS, None, hide_numba=True)
    assert "path numpy 0.9" in out
    lines = [line for line in out.splitlines() if line.startswith("onnxps.kernels")]
    assert lines == [
        "onnxps.kernels: onnxps kernels: NumPy path (numba is not installed "
        "(import of numba halted; None in sys.modules); pip install "
        "'onnxps[fast]' for the fused path)"
    ]


def test_numba_requested_without_numba_fails_clearly() -> None:
    code = """
        import numpy as np
        from onnxps.server.kernels import Stepper, make_attrs
        try:
            Stepper(make_attrs("Adam", {}), np.float32, [4])
        except RuntimeError as exc:
            print("refused:", exc)
    """
    out = run_python(code, "numba", hide_numba=True)
    assert out == (
        "refused: ONNXPS_KERNELS=numba, but numba is not installed (import of "
        "numba halted; None in sys.modules): install it with pip install "
        "'onnxps[fast]', or choose auto or numpy\n"
    )


@needs_numba
def test_with_numba_auto_takes_the_fused_path_and_says_so_once() -> None:
    out = run_python(TWO_STEPPERS, None, hide_numba=False)
    assert "path numba 0.9" in out
    lines = [line for line in out.splitlines() if line.startswith("onnxps.kernels")]
    assert len(lines) == 2, out
    assert re.match(
        r"onnxps\.kernels: onnxps kernels: numba \S+ fused kernels ready in "
        r"\d+\.\d\d s \((loaded from numba's cache|compiled)",
        lines[0],
    ), lines[0]
    assert (
        lines[1]
        == "onnxps.kernels: onnxps kernels: fused numba path (ONNXPS_KERNELS=auto)"
    )
