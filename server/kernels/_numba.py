"""Fused optimizer steps compiled with numba: one pass over X, G, V and H.

Each kernel reads an element's X, G and state once, does the whole ONNX update in
registers and writes X and the state once, where the NumPy path makes a pass per
operation. The operations, their operands and their grouping are exactly those of
``_fused``'s block functions, so the results are bit-identical:

- the coefficients arrive as scalars of the state dtype (``coefficients()`` rounds
  them once from float64), so float32 arithmetic stays float32: no Python float or
  literal enters the loop, which numba would widen to float64;
- no ``fastmath`` (numba's default): LLVM neither reorders nor contracts a multiply
  and an add into an FMA; vectorizing an element-wise loop changes no result;
- the loops index slices from 0, so numba knows every index is non-negative and
  emits no wrap-around test, which would keep LLVM from vectorizing (4x slower);
- ``error_model="numpy"``: a division by zero gives inf or NaN as in NumPy, instead
  of Python's ZeroDivisionError.

The kernels take whole tensors and an element range, release the GIL, and are
compiled for C-contiguous 1-D arrays of float32 and float64, with G writable or
read-only (a gradient decoded from the wire is a read-only buffer). ``load()``
compiles them, or loads them from numba's on-disk cache, once per process. The row
kernels (``"{op}_rows"``: a row push's rows of X, V and H stepped in place in one
pass, the same operations per element) compile on their first call instead.
``"all_finite_32"``/``"all_finite_64"`` check a gradient for NaN and inf in one
pass (``_finite``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["cache_note", "load"]

# The kernels see NumPy arrays of the state dtype and scalars of that dtype; numba
# compiles them from the signatures below and ignores these annotations.
Array = np.ndarray[Any, Any]


def _adagrad(
    x: Array,
    g: Array,
    h: Array,
    start: int,
    stop: int,
    nc: float,
    has_nc: bool,
    r: float,
    eps: float,
) -> None:
    x, g, h = x[start:stop], g[start:stop], h[start:stop]
    for i in range(x.size):
        gr = x[i] * nc + g[i] if has_nc else g[i]
        hi = h[i] + gr * gr
        h[i] = hi
        x[i] = x[i] - gr * r / (math.sqrt(hi) + eps)


def _momentum(
    x: Array,
    g: Array,
    v: Array,
    start: int,
    stop: int,
    nc: float,
    has_nc: bool,
    alpha: float,
    beta: float,
    r: float,
    nesterov: bool,
) -> None:
    x, g, v = x[start:stop], g[start:stop], v[start:stop]
    for i in range(x.size):
        gr = x[i] * nc + g[i] if has_nc else g[i]
        vi = v[i] * alpha + gr * beta
        v[i] = vi
        if nesterov:
            x[i] = x[i] - (gr + vi * alpha) * r
        else:
            x[i] = x[i] - vi * r


def _adam(
    x: Array,
    g: Array,
    v: Array,
    h: Array,
    start: int,
    stop: int,
    nc: float,
    has_nc: bool,
    alpha: float,
    oma: float,
    beta: float,
    omb: float,
    eps: float,
    r: float,
    post: float,
    has_post: bool,
) -> None:
    x, g, v, h = x[start:stop], g[start:stop], v[start:stop], h[start:stop]
    for i in range(x.size):
        gr = x[i] * nc + g[i] if has_nc else g[i]
        vi = v[i] * alpha + gr * oma
        hi = h[i] * beta + gr * gr * omb
        v[i] = vi
        h[i] = hi
        xi = x[i] - vi / (math.sqrt(hi) + eps) * r
        x[i] = xi * post if has_post else xi


# Row kernels: the same element updates on the rows ``idx`` of flat (rows, row)
# tensors, in place, with G holding one row per index (a row push's coalesced rows):
# gather, step and scatter in one pass, the same operations in the same order.
def _adagrad_rows(
    x: Array,
    g: Array,
    h: Array,
    idx: Array,
    row: int,
    nc: float,
    has_nc: bool,
    r: float,
    eps: float,
) -> None:
    for u in range(idx.size):
        base = idx[u] * row
        xr, gr_, hr = (
            x[base : base + row],
            g[u * row : u * row + row],
            h[base : base + row],
        )
        for i in range(row):
            gr = xr[i] * nc + gr_[i] if has_nc else gr_[i]
            hi = hr[i] + gr * gr
            hr[i] = hi
            xr[i] = xr[i] - gr * r / (math.sqrt(hi) + eps)


def _momentum_rows(
    x: Array,
    g: Array,
    v: Array,
    idx: Array,
    row: int,
    nc: float,
    has_nc: bool,
    alpha: float,
    beta: float,
    r: float,
    nesterov: bool,
) -> None:
    for u in range(idx.size):
        base = idx[u] * row
        xr, gr_, vr = (
            x[base : base + row],
            g[u * row : u * row + row],
            v[base : base + row],
        )
        for i in range(row):
            gr = xr[i] * nc + gr_[i] if has_nc else gr_[i]
            vi = vr[i] * alpha + gr * beta
            vr[i] = vi
            if nesterov:
                xr[i] = xr[i] - (gr + vi * alpha) * r
            else:
                xr[i] = xr[i] - vi * r


def _adam_rows(
    x: Array,
    g: Array,
    v: Array,
    h: Array,
    idx: Array,
    row: int,
    nc: float,
    has_nc: bool,
    alpha: float,
    oma: float,
    beta: float,
    omb: float,
    eps: float,
    r: float,
    post: float,
    has_post: bool,
) -> None:
    for u in range(idx.size):
        base = idx[u] * row
        xr, gr_ = x[base : base + row], g[u * row : u * row + row]
        vr, hr = v[base : base + row], h[base : base + row]
        for i in range(row):
            gr = xr[i] * nc + gr_[i] if has_nc else gr_[i]
            vi = vr[i] * alpha + gr * oma
            hi = hr[i] * beta + gr * gr * omb
            vr[i] = vi
            hr[i] = hi
            xi = xr[i] - vi / (math.sqrt(hi) + eps) * r
            xr[i] = xi * post if has_post else xi


# The finiteness check (``_finite``): NaN and inf are the bit patterns whose exponent
# is all ones, i.e. ``bits & ~sign >= bits of +inf``. A max over each block (an
# unsigned reduction, which LLVM vectorizes, unlike an early exit per element), then
# one test per block.
_FINITE_BLOCK = 1 << 14


def _all_finite_32(x: Array) -> bool:
    u = x.view(np.uint32)
    for s in range(0, u.size, _FINITE_BLOCK):
        block = u[s : s + _FINITE_BLOCK]
        m = np.uint32(0)
        for i in range(block.size):
            m = max(m, block[i] & np.uint32(0x7FFFFFFF))
        if m >= np.uint32(0x7F800000):
            return False
    return True


def _all_finite_64(x: Array) -> bool:
    u = x.view(np.uint64)
    for s in range(0, u.size, _FINITE_BLOCK):
        block = u[s : s + _FINITE_BLOCK]
        m = np.uint64(0)
        for i in range(block.size):
            m = max(m, block[i] & np.uint64(0x7FFFFFFFFFFFFFFF))
        if m >= np.uint64(0x7FF0000000000000):
            return False
    return True


def _finite_signatures(bits: int) -> list[Any]:
    from numba import types

    scalar = types.float32 if bits == 32 else types.float64
    return [
        types.boolean(types.Array(scalar, 1, "C", readonly=readonly))
        for readonly in (False, True)
    ]


# Each kernel's arguments in order: a, a state or X array; g, the gradient (writable or
# read-only); i, an element index; f, a scalar of the state dtype; b, a flag.
_LAYOUTS = {
    "Adagrad": "agaiifbff",
    "Momentum": "agaiifbfffb",
    "Adam": "agaaiifbfffffffb",
}


def _signatures(op: str) -> list[Any]:
    from numba import types

    sigs = []
    for scalar in (types.float32, types.float64):
        array = types.Array(scalar, 1, "C")
        for grad in (array, types.Array(scalar, 1, "C", readonly=True)):
            kinds = {
                "a": array,
                "g": grad,
                "i": types.int64,
                "f": scalar,
                "b": types.boolean,
            }
            sigs.append(types.void(*(kinds[k] for k in _LAYOUTS[op])))
    return sigs


_PY_FUNCS: dict[str, Any] = {
    "Adagrad": _adagrad,
    "Momentum": _momentum,
    "Adam": _adam,
    "Adagrad_rows": _adagrad_rows,
    "Momentum_rows": _momentum_rows,
    "Adam_rows": _adam_rows,
}


def load() -> dict[str, Callable[..., Any]]:
    """The compiled kernels by operator (and ``"{op}_rows"``, a row push's);
    raises ImportError without numba.

    Uses numba's on-disk cache (next to this file, or in ``NUMBA_CACHE_DIR``, or
    the user's cache directory, whichever is writable) and compiles without it
    when none is.
    """
    import numba

    kernels: dict[str, Callable[..., Any]] = {}
    for op, fn in _PY_FUNCS.items():
        options: dict[str, Any] = {"nogil": True, "error_model": "numpy"}
        # The row kernels compile on their first call (a group's first row push),
        # for the types it brings: a server that never sees one never pays for them.
        sigs = None if op.endswith("_rows") else _signatures(op)
        try:
            kernels[op] = numba.njit(sigs, cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            kernels[op] = numba.njit(sigs, **options)(fn)
    for bits, fn in ((32, _all_finite_32), (64, _all_finite_64)):
        sigs = _finite_signatures(bits)
        try:
            kernels[f"all_finite_{bits}"] = numba.njit(sigs, cache=True, nogil=True)(fn)
        except RuntimeError:
            kernels[f"all_finite_{bits}"] = numba.njit(sigs, nogil=True)(fn)
    return kernels


def cache_note(kernels: dict[str, Any]) -> str:
    """Where the kernels came from: numba's cache, or a compile (and whether kept)."""
    stats = [k.stats for k in kernels.values()]
    paths = sorted({s.cache_path for s in stats if s.cache_path})
    if not paths:
        return (
            "compiled; no writable cache directory, so every process compiles "
            "them again (set NUMBA_CACHE_DIR to a writable directory)"
        )
    where = ", ".join(paths)
    if any(s.cache_misses for s in stats):
        return f"compiled and cached in {where}"
    return f"loaded from numba's cache in {where}"
