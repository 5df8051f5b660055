"""Tensors in 2 bytes per element on the wire: bfloat16 and float16 encodings.

An encoding changes how a FLOAT or DOUBLE tensor's elements travel, never what the
tensor is: its dtype and dims stay the group's, and the receiver widens the 2-byte
values exactly (every bfloat16 and float16 value is a float32 and a float64 value).
The one rounding happens at the sender, to nearest with ties to even:

- bfloat16: the upper 16 bits of the float32 value, rounded on the lower 16 (a
  float64 value is first rounded to float32 *to odd*, so that the two roundings give
  the correctly rounded bfloat16); NaN stays NaN (quiet, sign kept).
- float16: IEEE 754 binary16 (float64 values also through float32 rounded to odd).

Both run as integer operations on the float32 bits, block by block, both ways
(NumPy's float16 casts are scalar loops, several times slower); with numba installed
(``pip install 'onnxps[fast]'``) the float32 encodings and the float16 widening run
as one compiled loop instead (``_codec_numba``, the same bits), unless
``ONNXPS_KERNELS=numpy``.

A finite value whose encoding would be infinite (beyond bfloat16's 3.39e38 or
float16's 65504) is refused with ``EncodingRangeError``, never sent as inf; values
below the encoding's smallest subnormal become (signed) zero, as any rounding does.

In the client an encoded array is an array of an ``ENCODED`` dtype: one little-endian
uint16 field whose name says the encoding and the dtype it stands for. It slices,
splits (a cluster's parts) and chunks like any array, and the codec reads the dtype
and the encoding off it when it writes the tensor message.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ._pageout import page_out
from .errors import OnnxpsError

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


log = logging.getLogger("onnxps.encoding")


class EncodingRangeError(OnnxpsError, ValueError):
    """A finite value that the asked encoding cannot hold (it would become inf)."""


_codec_lock = threading.Lock()
_codec_start_lock = threading.Lock()
_codec_loaded: dict[str, dict[str, Callable[..., Any]] | None] = {}


def compiled_codec(wait: bool = True) -> dict[str, Callable[..., Any]] | None:
    """numba's loops (``_codec_numba``), or None for the NumPy path: as
    ``ONNXPS_KERNELS`` says (``auto``, the default: numba when it imports and
    compiles; ``numpy``: never; ``numba``: numba or RuntimeError).

    ``wait=False`` (the encode and widen paths): on ``auto``, None (the NumPy
    path, the same bits) until the loops are in, whose load (a compile of 2 to
    20 s with an empty numba cache) starts on a thread at the first such call;
    so no call waits for it."""
    choice = os.environ.get("ONNXPS_KERNELS", "").strip().lower() or "auto"
    if choice == "numpy":
        return None
    if not wait and choice == "auto" and "loops" not in _codec_loaded:
        _load_codec_in_background()
        return None
    with _codec_lock:
        if "loops" not in _codec_loaded:
            try:
                from . import _codec_numba

                _codec_loaded["loops"] = _codec_numba.load()
                page_out()  # LLVM's code, not needed again until a compile
            except ImportError:
                _codec_loaded["loops"] = None
            except Exception as exc:  # noqa: BLE001 - a compile failure: say it
                log.warning("numba failed to compile the encoding loops: %r", exc)
                _codec_loaded["loops"] = None
        loops = _codec_loaded["loops"]
    if loops is None and choice == "numba":
        raise RuntimeError(
            "ONNXPS_KERNELS=numba but numba's encoding loops are not available "
            "(pip install 'onnxps[fast]')"
        )
    return loops


_codec_loading: list[threading.Thread] = []


def _load_codec_in_background() -> None:
    with _codec_start_lock:
        if not _codec_loading:
            thread = threading.Thread(
                target=compiled_codec, name="onnxps-codec", daemon=True
            )
            _codec_loading.append(thread)
            thread.start()


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
    arr = _encodable(arr, encoding, what)
    out = np.empty(arr.shape, encoded_dtype(encoding, arr.dtype))
    _encode_flat(arr.reshape(-1), out.reshape(-1).view(np.uint16), encoding, what)
    return out


def _encodable(arr: Array, encoding: str, what: str) -> Array:
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
        raise TypeError(
            f"{what} is {arr.dtype}: the {encoding} encoding applies to float32 and "
            "float64 tensors (the group's dtype)"
        )
    return np.asarray(arr, dtype=arr.dtype.newbyteorder("="), order="C")  # keeps 0-d


class DeferredEncoding:
    """A gradient to send in ``encoding``, encoded block by block as it is sent
    (the data channel), so that encoding overlaps the sending; ``encoded()`` the
    whole of it at once (any other path). It stands in for the encoded array:
    ``shape``, ``dtype`` (the ENCODED one) and ``nbytes`` are the encoded
    array's. A finite value the encoding cannot hold raises ``EncodingRangeError``
    when its block is reached."""

    def __init__(self, a: Any, encoding: str, what: str = "tensor") -> None:
        self.native = _encodable(np.asarray(a), encoding, what)
        self.encoding = encoding
        self.what = what
        self.shape: tuple[int, ...] = self.native.shape
        self.dtype: np.dtype[Any] = encoded_dtype(encoding, self.native.dtype)
        self.size = self.native.size
        self.nbytes = self.size * 2

    def encoded(self) -> Array:
        out = np.empty(self.shape, self.dtype)
        flat = out.reshape(-1).view(np.uint16)
        _encode_flat(self.native.reshape(-1), flat, self.encoding, self.what)
        return out

    def blocks(self, elements: int) -> Iterator[Array]:
        """The encoded 2-byte values, ``elements`` at a time (one buffer, reused:
        each block is valid until the next is asked for)."""
        src = self.native.reshape(-1)
        buf = np.empty(min(elements, src.size), np.uint16)
        for start in range(0, src.size, elements):
            x = src[start : start + elements]
            dst = buf[: x.size]
            _encode_flat(x, dst, self.encoding, self.what, start)
            yield dst


def _encode_flat(
    src: Array, dst: Array, encoding: str, what: str, offset: int = 0
) -> None:
    """Encode 1-D ``src`` into uint16 ``dst``; an overflow names element
    ``offset`` + its index."""
    loops = compiled_codec(wait=False)
    if loops is not None:
        _encode_compiled(loops[encoding], src, dst, encoding, what, offset)
        return
    block = min(_BLOCK, src.size)
    scratch = [np.empty(block, np.uint32) for _ in range(3)]
    mask = np.empty(block, np.bool_)
    rounded = np.empty(block, np.float32) if src.itemsize == 8 else None
    to_bits, inf = (_bfloat16, 0x7F80) if encoding == "bfloat16" else (_float16, 0x7C00)
    for start in range(0, src.size, _BLOCK):
        x = src[start : start + _BLOCK]
        o = dst[start : start + _BLOCK]
        if rounded is not None:
            x32 = rounded[: x.size]
            _to_float32_odd(x, x32)
        else:
            x32 = x
        k = x.size
        to_bits(x32, o, [t[:k] for t in scratch], mask[:k])
        magnitude = scratch[0][:k].view(np.uint16)[:k]  # scratch is free again
        np.bitwise_and(o, 0x7FFF, out=magnitude)
        overflow = np.equal(magnitude, inf, out=mask[:k])
        if overflow.any():
            _refuse_overflow(x, overflow, offset + start, encoding, what)


def _encode_compiled(
    loop: Callable[[Array, Array], bool],
    src: Array,
    dst: Array,
    encoding: str,
    what: str,
    offset: int = 0,
) -> None:
    """Encode ``src`` into ``dst`` with numba's loop (float64 first rounded to
    float32 to odd, block by block); refuse the first finite overflow."""
    if src.dtype.itemsize == 4:
        if loop(src.view(np.uint32), dst):
            _refuse_first_overflow(src, dst, offset, encoding, what)
        return
    rounded = np.empty(min(_BLOCK, src.size), np.float32)
    for start in range(0, src.size, _BLOCK):
        x = src[start : start + _BLOCK]
        x32 = rounded[: x.size]
        _to_float32_odd(x, x32)
        o = dst[start : start + _BLOCK]
        if loop(x32.view(np.uint32), o):
            _refuse_first_overflow(x, o, offset + start, encoding, what)


def _refuse_first_overflow(
    x: Array, encoded: Array, start: int, encoding: str, what: str
) -> None:
    inf = 0x7F80 if encoding == "bfloat16" else 0x7C00
    _refuse_overflow(x, (encoded & 0x7FFF) == inf, start, encoding, what)


def _to_float32_odd(x: Array, out: Array) -> None:
    """float64 -> float32 rounded to odd: bfloat16 rounding of it is then correct."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf, NaN: handled after
        np.copyto(out, x, casting="same_kind")  # to nearest even
        back = out.astype(np.float64)
    inexact = back != x
    inexact &= ~np.isnan(x)
    if inexact.any():
        bits = out.view(np.uint32)
        away = inexact & (np.abs(back) > np.abs(x))
        bits[away] -= 1  # one step toward zero: truncated (inf -> the largest)
        bits[inexact] |= 1


def _bfloat16(x32: Array, out: Array, scratch: list[Array], nan: Array) -> None:
    """The bfloat16 bits of float32 ``x32``, to nearest even, into uint16 ``out``."""
    b = x32.view(np.uint32)
    t = scratch[0]
    np.right_shift(b, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, b, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    np.isnan(x32, out=nan)
    if nan.any():  # rounding could carry a NaN's payload into inf, or wrap
        out[nan] = (b[nan] >> 16) | 0x0040


def _float16(x32: Array, out: Array, scratch: list[Array], mask: Array) -> None:
    """The float16 bits of float32 ``x32``, to nearest even, into uint16 ``out``
    (F. Giesen's float_to_half_fast3_rtne, on whole blocks)."""
    b = x32.view(np.uint32)
    a, t, s = scratch
    np.bitwise_and(b, 0x7FFFFFFF, out=a)  # |x|
    # normal results: rebias the exponent, round the 13 dropped bits to even
    np.right_shift(a, 13, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, a, out=t)
    np.add(t, 0xFFF - 0x38000000 + (1 << 32), out=t)  # wraps: fixed below
    np.right_shift(t, 13, out=t)
    np.less(a, 0x38800000, out=mask)  # below 2^-14: zero or a float16 subnormal
    if mask.any():
        # adding 0.5 aligns the subnormal's bits; the FPU rounds to nearest even
        with np.errstate(invalid="ignore"):  # NaN lanes, not selected
            np.add(a.view(np.float32), np.float32(0.5), out=s.view(np.float32))
        np.subtract(s, 0x3F000000, out=s)
        np.copyto(t, s, where=mask)
    np.greater_equal(a, 0x47800000, out=mask)  # 65536 and up: inf, or NaN
    if mask.any():
        np.copyto(t, 0x7C00, where=mask)
        np.greater(a, 0x7F800000, out=mask)
        np.copyto(t, 0x7E00, where=mask)
    np.right_shift(b, 16, out=s)
    np.bitwise_and(s, 0x8000, out=s)
    np.bitwise_or(t, s, out=t)
    np.copyto(out, t, casting="unsafe")


def _refuse_overflow(
    x: Array, overflow: Array, start: int, encoding: str, what: str
) -> None:
    finite = np.flatnonzero(overflow & np.isfinite(x))
    if finite.size:
        i = int(finite[0])
        _refuse_value(float(x[i]), start + i, encoding, what)


def _refuse_value(value: float, index: int, encoding: str, what: str) -> None:
    raise EncodingRangeError(
        f"{what} holds {value!r} (element {index}), beyond {encoding}'s "
        f"largest finite value {_LARGEST[encoding]}: it would arrive as inf. "
        "Send it native (encoding='native')"
        + (" or as bfloat16 (float32's range)" if encoding == "float16" else "")
    )


def widen_into(out: Array, data: Any, code: int) -> None:
    """Widen the 2-byte values in ``data`` (bytes) into ``out`` (1-D float32 or
    float64, as many elements), exactly: the only pass over the bytes."""
    u = np.frombuffer(data, dtype="<u2")
    if code == pb.ENCODING_BFLOAT16 and out.dtype.itemsize == 4:
        np.left_shift(u, 16, out=out.view(np.uint32), dtype=np.uint32)
        return
    loops = compiled_codec(wait=False) if code == pb.ENCODING_FLOAT16 else None
    if loops is not None and out.dtype.itemsize == 4:
        loops["widen_float16"](u, out.view(np.uint32))
        return
    if loops is not None:
        bits32 = np.empty(min(_BLOCK, u.size), np.uint32)
        for start in range(0, u.size, _BLOCK):
            src = u[start : start + _BLOCK]
            bits = bits32[: src.size]
            loops["widen_float16"](src, bits)
            with np.errstate(invalid="ignore"):  # a signalling NaN stays NaN
                np.copyto(out[start : start + _BLOCK], bits.view(np.float32))
        return
    to_float32 = _float16_bits if code == pb.ENCODING_FLOAT16 else _bfloat16_bits
    block = min(_BLOCK, u.size)
    scratch = [np.empty(block, np.uint32) for _ in range(3)]
    mask = np.empty(block, np.bool_)
    for start in range(0, u.size, _BLOCK):
        src = u[start : start + _BLOCK]
        dst = out[start : start + _BLOCK]
        k = src.size
        if out.dtype.itemsize == 4:
            to_float32(src, dst.view(np.uint32), [t[:k] for t in scratch], mask[:k])
        else:
            bits = scratch[2][:k]
            to_float32(src, bits, [t[:k] for t in scratch[:2]], mask[:k])
            with np.errstate(invalid="ignore"):  # a signalling NaN stays NaN
                np.copyto(dst, bits.view(np.float32))


def _bfloat16_bits(u: Array, out: Array, scratch: list[Array], mask: Array) -> None:
    np.left_shift(u, 16, out=out, dtype=np.uint32)


def _float16_bits(u: Array, out: Array, scratch: list[Array], mask: Array) -> None:
    """The float32 bits of the float16 values ``u``, into uint32 ``out`` (F.
    Giesen's half_to_float, on whole blocks; every step is exact)."""
    t, e = scratch[0], scratch[1]
    np.left_shift(u, 13, out=t, dtype=np.uint32)
    np.bitwise_and(t, 0x10000000, out=e)  # the sign, 3 bits short of its place
    np.left_shift(e, 3, out=e)
    np.bitwise_and(t, 0x0FFFE000, out=out)  # exponent and mantissa
    np.bitwise_and(out, 0x0F800000, out=t)  # the exponent alone
    np.add(out, 0x38000000, out=out)  # rebias 15 -> 127
    np.equal(t, 0x0F800000, out=mask)  # inf, NaN: to float32's top exponent
    if mask.any():
        np.add(out, 0x38000000, out=out, where=mask)
    np.equal(t, 0, out=mask)  # zero or subnormal: renormalised by the FPU
    if mask.any():
        np.add(out, 0x00800000, out=out, where=mask)
        f = out.view(np.float32)
        np.subtract(f, np.float32(2.0**-14), out=f, where=mask)
    np.bitwise_or(out, e, out=out)


def decode(encoded: Array) -> Array:
    """An ENCODED array widened to the dtype it stands for (tests, benchmarks)."""
    dtype, code = ENCODED[encoded.dtype]
    out = np.empty(encoded.shape, dtype)
    data = np.asarray(encoded, order="C").reshape(-1).view(np.uint16)
    widen_into(out.reshape(-1), data, code)
    return out
