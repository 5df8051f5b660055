"""Tensors in 2 bytes per element on the wire: bfloat16 and float16 encodings.

An encoding changes how a FLOAT or DOUBLE tensor's elements travel, never what the
tensor is: its dtype and dims stay the group's, and the receiver widens the 2-byte
values exactly (every bfloat16 and float16 value is a float32 and a float64 value).
The one rounding happens at the sender, to nearest with ties to even:

- bfloat16: the upper 16 bits of the float32 value, rounded on the lower 16 (a
  float64 value is first rounded to float32 *to odd*, so that the two roundings give
  the correctly rounded bfloat16); NaN stays NaN (quiet, sign kept).
- float16: IEEE 754 binary16 (NumPy's cast, which rounds float64 directly).

A finite value whose encoding would be infinite (beyond bfloat16's 3.39e38 or
float16's 65504) is refused with ``EncodingRangeError``, never sent as inf; values
below the encoding's smallest subnormal become (signed) zero, as any rounding does.

In the client an encoded array is an array of an ``ENCODED`` dtype: one little-endian
uint16 field whose name says the encoding and the dtype it stands for. It slices,
splits (a cluster's parts) and chunks like any array, and the codec reads the dtype
and the encoding off it when it writes the tensor message.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ._errors import OnnxpsError

__all__ = [
    "ENCODED",
    "ENCODINGS",
    "ENCODING_NAMES",
    "ENCODING_TO_PROTO",
    "Encoding",
    "EncodingRangeError",
    "check_encoding",
    "decode",
    "encode",
    "encoded_dtype",
    "widen_into",
]

Array = np.ndarray[Any, Any]
Encoding = Literal["native", "bfloat16", "float16"]
ENCODINGS: tuple[Encoding, ...] = ("native", "bfloat16", "float16")
ENCODING_TO_PROTO: dict[str, pb.Encoding.ValueType] = {
    "native": pb.ENCODING_UNSPECIFIED,
    "bfloat16": pb.ENCODING_BFLOAT16,
    "float16": pb.ENCODING_FLOAT16,
}
ENCODING_NAMES: dict[int, str] = {
    pb.ENCODING_UNSPECIFIED: "native",
    pb.ENCODING_BFLOAT16: "bfloat16",
    pb.ENCODING_FLOAT16: "float16",
}
_LARGEST = {"bfloat16": "3.3895e+38", "float16": "65504"}
_BLOCK = 1 << 16  # elements per pass: the scratch stays in cache

_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
ENCODED: dict[np.dtype[Any], tuple[np.dtype[Any], pb.Encoding.ValueType]] = {
    np.dtype([(f"{name} of {dtype.name}", "<u2")]): (dtype, ENCODING_TO_PROTO[name])
    for name in ("bfloat16", "float16")
    for dtype in (_F32, _F64)
}
_ENCODED_BY = {(code, dtype): enc for enc, (dtype, code) in ENCODED.items()}


class EncodingRangeError(OnnxpsError, ValueError):
    """A finite value that the asked encoding cannot hold (it would become inf)."""


def check_encoding(value: Any, what: str = "encoding") -> Encoding:
    """``value`` as an encoding name (None: native); ValueError naming the choices."""
    if value is None:
        return "native"
    if value not in ENCODINGS:
        raise ValueError(
            f"{what} must be one of {', '.join(ENCODINGS)} (or None: native), got "
            f"{value!r}"
        )
    enc: Encoding = value
    return enc


def encoded_dtype(encoding: str, dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The ENCODED dtype of ``dtype`` (float32 or float64) in ``encoding``."""
    return _ENCODED_BY[(ENCODING_TO_PROTO[encoding], np.dtype(dtype).newbyteorder("<"))]


def encode(a: Any, encoding: str, what: str = "tensor") -> Array:
    """``a`` (float32 or float64) in ``encoding``: an array of an ENCODED dtype, the
    same shape; ``a`` itself as an array when ``encoding`` is native."""
    arr = np.asarray(a)
    if encoding == "native":
        return arr
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
        raise TypeError(
            f"{what} is {arr.dtype}: the {encoding} encoding applies to float32 and "
            "float64 tensors (the group's dtype)"
        )
    arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("="), order="C")  # keeps 0-d
    out = np.empty(arr.shape, encoded_dtype(encoding, arr.dtype))
    src = arr.reshape(-1)
    dst = out.reshape(-1).view(np.uint16)
    scratch = np.empty(min(_BLOCK, src.size), np.uint32)
    rounded = np.empty(min(_BLOCK, src.size), np.float32) if arr.itemsize == 8 else None
    for start in range(0, src.size, _BLOCK):
        x = src[start : start + _BLOCK]
        o = dst[start : start + _BLOCK]
        if encoding == "float16":
            with np.errstate(over="ignore"):
                np.copyto(o.view(np.float16), x, casting="same_kind")
            overflow = np.isinf(o.view(np.float16))
        else:
            if rounded is not None:
                x32 = rounded[: x.size]
                _to_float32_odd(x, x32)
            else:
                x32 = x
            _bfloat16(x32, o, scratch[: x.size])
            overflow = (o & 0x7FFF) == 0x7F80
        if overflow.any():
            _refuse_overflow(x, overflow, start, encoding, what)
    return out


def _to_float32_odd(x: Array, out: Array) -> None:
    """float64 -> float32 rounded to odd: bfloat16 rounding of it is then correct."""
    with np.errstate(over="ignore"):
        np.copyto(out, x, casting="same_kind")  # to nearest even
    back = out.astype(np.float64)
    inexact = back != x
    inexact &= ~np.isnan(x)
    if inexact.any():
        bits = out.view(np.uint32)
        away = inexact & (np.abs(back) > np.abs(x))
        bits[away] -= 1  # one step toward zero: truncated (inf -> the largest)
        bits[inexact] |= 1


def _bfloat16(x32: Array, out: Array, t: Array) -> None:
    """The bfloat16 bits of float32 ``x32``, to nearest even, into uint16 ``out``."""
    b = x32.view(np.uint32)
    np.right_shift(b, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, b, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    nan = np.isnan(x32)
    if nan.any():  # rounding could carry a NaN's payload into inf, or wrap
        out[nan] = (b[nan] >> 16) | 0x0040


def _refuse_overflow(
    x: Array, overflow: Array, start: int, encoding: str, what: str
) -> None:
    finite = np.flatnonzero(overflow & np.isfinite(x))
    if finite.size:
        i = int(finite[0])
        raise EncodingRangeError(
            f"{what} holds {float(x[i])!r} (element {start + i}), beyond {encoding}'s "
            f"largest finite value {_LARGEST[encoding]}: it would arrive as inf. "
            "Send it native (encoding='native')"
            + (" or as bfloat16 (float32's range)" if encoding == "float16" else "")
        )


def widen_into(out: Array, data: Any, code: int) -> None:
    """Widen the 2-byte values in ``data`` (bytes) into ``out`` (1-D float32 or
    float64, as many elements), exactly: the only pass over the bytes."""
    u = np.frombuffer(data, dtype="<u2")
    if code == pb.ENCODING_FLOAT16:
        np.copyto(out, u.view(np.float16))
    elif out.dtype.itemsize == 4:
        np.left_shift(u, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        t = np.empty(min(_BLOCK, u.size), np.uint32)
        for start in range(0, u.size, _BLOCK):
            block = t[: min(_BLOCK, u.size - start)]
            np.left_shift(u[start : start + _BLOCK], 16, out=block, dtype=np.uint32)
            np.copyto(out[start : start + _BLOCK], block.view(np.float32))


def decode(encoded: Array) -> Array:
    """An ENCODED array widened to the dtype it stands for (tests, benchmarks)."""
    dtype, code = ENCODED[encoded.dtype]
    out = np.empty(encoded.shape, dtype)
    data = np.asarray(encoded, order="C").reshape(-1).view(np.uint16)
    widen_into(out.reshape(-1), data, code)
    return out
