"""Is every element of a tensor finite? One pass over its bytes.

A push is refused before it changes anything when a gradient holds NaN or inf, so
every large push reads its gradients once for this. ``np.isfinite(a).all()`` writes
a boolean temporary the size of ``a`` and ``min``/``max`` read ``a`` twice; this
reads it once:

- the fused path (numba, as ``_select`` chooses): a compiled loop over the IEEE bit
  patterns: an element is NaN or inf exactly when its exponent bits are all ones,
  that is when ``bits & ~sign >= bits of inf``; the loop keeps an unsigned maximum
  of ``bits & ~sign`` per block (a reduction LLVM vectorizes) and stops at the first
  block that holds one;
- the NumPy path: ``np.isfinite`` over blocks into one small reused mask.

Both give the same answer for every value (tests check each float class at every
position of a block); only which is faster differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._select import current_path, fused_kernels

__all__ = ["FUSED_MIN_ELEMENTS", "all_finite", "finite_checker"]

Array = np.ndarray[Any, Any]

# Below this, one isfinite call is as fast as anything (and needs no kernel).
FUSED_MIN_ELEMENTS = 1 << 16
_NUMPY_BLOCK = 1 << 18
_ALL_TRUE = np.logical_and.reduce
# the fused kernel per dtype (native byte order only)
_KERNELS = {
    np.dtype(np.float32).str: "all_finite_32",
    np.dtype(np.float64).str: "all_finite_64",
}


def all_finite(a: Array) -> bool:
    """True when the float array ``a`` (any layout) holds no NaN and no inf."""
    if a.size < FUSED_MIN_ELEMENTS:  # whichever the path: no need to choose it
        return a.size == 0 or _small_all_finite(a)
    return finite_checker()(a)


def _small_all_finite(a: Array) -> bool:
    # the reduction itself, without ``ndarray.all``'s Python wrapper
    return bool(_ALL_TRUE(np.isfinite(a), axis=None))


def finite_checker() -> Callable[[Array], bool]:
    """``all_finite`` with the kernel path chosen now, for many calls in a row
    (the chunks of one stream)."""
    kernels = fused_kernels() if current_path() == "numba" else None

    def check(a: Array) -> bool:
        if a.size < FUSED_MIN_ELEMENTS:
            return a.size == 0 or bool(np.isfinite(a).all())
        kernel = _KERNELS.get(a.dtype.str)
        if kernels is not None and kernel is not None and a.flags.c_contiguous:
            return bool(kernels[kernel](a.reshape(-1)))
        return _numpy_all_finite(a)

    return check


def _numpy_all_finite(a: Array) -> bool:
    flat = a.reshape(-1)  # a copy only when ``a`` is not contiguous
    mask = np.empty(min(flat.size, _NUMPY_BLOCK), np.bool_)
    for start in range(0, flat.size, _NUMPY_BLOCK):
        block = flat[start : start + _NUMPY_BLOCK]
        m = mask[: block.size]
        np.isfinite(block, out=m)
        if not m.all():
            return False
    return True
