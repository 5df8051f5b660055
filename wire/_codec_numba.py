"""The 2-byte encodings in one compiled pass per block: numba's loops.

The NumPy path of ``encoding`` makes a pass over the block per integer operation
(five for bfloat16, about twelve for float16). These loops do the same integer
operations per element in registers, branch-free (selects, so LLVM vectorizes
them: 0.17 ns/element for bfloat16, 0.38 for float16, against 0.80 and 1.43), so
they give the same bits (a test compares both paths on every float16 value, on
random float32 bit patterns and on the special values; every one of the 2^32
float32 patterns was compared once, offline):

- bfloat16 of float32: the upper 16 bits rounded to nearest even on the lower 16;
  a NaN keeps its sign and upper payload, made quiet;
- float16 of float32: F. Giesen's float_to_half_fast3_rtne for normal results; a
  result below 2^-14 (zero or a float16 subnormal) is the float32 significand
  shifted right and rounded to nearest even, in integers (the NumPy path lets the
  FPU do that rounding: the same result);
- float32 bits of float16: exact; a float16 subnormal is normalised in integers.

Each encoding loop also returns whether a finite value became inf (the caller
then finds the first for ``EncodingRangeError``). Integers are int64/uint64 in the
loops (numba widens narrower ones anyway), masked back to 32 bits where a sum must
wrap. ``load()`` compiles the loops once per process, or loads them from numba's
on-disk cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["load"]

Array = np.ndarray[Any, Any]


def _bfloat16_of_float32(b: Array, out: Array) -> Any:
    overflow: Any = False
    for i in range(b.size):
        x = np.uint64(b[i])
        a = x & np.uint64(0x7FFFFFFF)
        rounded = (
            (x + np.uint64(0x7FFF) + ((x >> np.uint64(16)) & np.uint64(1)))
            & np.uint64(0xFFFFFFFF)
        ) >> np.uint64(16)
        quiet = (x >> np.uint64(16)) | np.uint64(0x0040)  # NaN: sign, payload kept
        o = quiet if a > np.uint64(0x7F800000) else rounded
        overflow |= (a < np.uint64(0x7F800000)) & (
            (rounded & np.uint64(0x7FFF)) == np.uint64(0x7F80)
        )
        out[i] = np.uint16(o & np.uint64(0xFFFF))
    return overflow


def _float16_of_float32(b: Array, out: Array) -> Any:
    overflow: Any = False
    for i in range(b.size):
        x = np.int64(b[i])
        a = x & 0x7FFFFFFF
        # normal results: rebias the exponent, round the 13 dropped bits to even
        normal = ((a + 0xC8000FFF + ((a >> 13) & 1)) & 0xFFFFFFFF) >> 13
        # below 2^-14: the significand m * 2^(e - 150) in units of 2^-24, rounded
        # to nearest even (a shift of 25 or more leaves 0: m < 2^24)
        m = (a & 0x7FFFFF) | 0x800000
        s: Any = 126 - (a >> 23)
        s = s if s < 25 else 25
        s = s if s > 1 else 1  # (the other branches' lanes)
        q = m >> s
        r = m & ((1 << s) - 1)
        half = 1 << (s - 1)
        q += (r > half) | ((r == half) & ((q & 1) == 1))
        o = q if a < 0x38800000 else normal
        big = 0x7E00 if a > 0x7F800000 else 0x7C00  # 65536 and up: inf, or NaN
        o = big if a >= 0x47800000 else o
        overflow |= (a < 0x7F800000) & (o == 0x7C00)
        out[i] = np.uint16(o | ((x >> 16) & 0x8000))
    return overflow


def _float32_bits_of_float16(u: Array, out: Array) -> None:
    for i in range(u.size):
        h = np.int64(u[i])
        em = h & 0x7FFF
        m = h & 0x3FF
        normal = (em << 13) + 0x38000000  # rebias 15 -> 127
        top = (em << 13) + 0x70000000  # inf, NaN: float32's top exponent
        # a subnormal m * 2^-24: the position p of m's leading bit, branch-free
        t = m
        c = np.int64(t >= 256)
        p: Any = 8 * c
        t >>= 8 * c
        c = np.int64(t >= 16)
        p += 4 * c
        t >>= 4 * c
        c = np.int64(t >= 4)
        p += 2 * c
        t >>= 2 * c
        p += np.int64(t >= 2)
        sub = ((p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFF)
        sub = sub if m != 0 else 0
        e = em >> 10
        o = top if e == 31 else (normal if e != 0 else sub)
        out[i] = np.uint32(o | ((h & 0x8000) << 16))


def load() -> dict[str, Callable[..., Any]]:
    """The compiled loops by name (``bfloat16``, ``float16``: encode the uint32
    bits of float32 values into uint16; ``widen_float16``: float16 to the uint32
    bits of float32). Raises ImportError without numba."""
    import numba

    u32 = numba.types.Array(numba.uint32, 1, "C", readonly=True)
    u16_in = numba.types.Array(numba.uint16, 1, "C", readonly=True)
    u16 = numba.types.Array(numba.uint16, 1, "C")
    u32_out = numba.types.Array(numba.uint32, 1, "C")

    def jit(signature: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled: Callable[..., Any] = numba.njit(
            signature, nogil=True, cache=True, error_model="numpy"
        )(fn)
        return compiled

    return {
        "bfloat16": jit(numba.boolean(u32, u16), _bfloat16_of_float32),
        "float16": jit(numba.boolean(u32, u16), _float16_of_float32),
        "widen_float16": jit(numba.void(u16_in, u32_out), _float32_bits_of_float16),
    }
