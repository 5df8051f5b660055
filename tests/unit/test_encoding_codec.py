"""The bfloat16 and float16 wire encodings: rounding, special values, refusals, and
the exact widening, checked against ml_dtypes (bfloat16 of float32), NumPy's float16
and an exact rational oracle (bfloat16 of float64).

Every test runs on both codec paths (``kernels``: NumPy's block passes and numba's
compiled loops), and the two are compared on every float16 value and on random
float32 bit patterns."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kernel_paths import HAVE_NUMBA, NO_NUMBA, each_kernel_path  # noqa: F401
from onnxps.client import EncodingRangeError
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire import _codec_numba
from onnxps.wire import encoding as _encoding
from onnxps.wire.codec import (
    ENCODED,
    TensorAssembler,
    TensorFormatError,
    array_to_tensor,
    chunk_messages,
    decode,
    encode,
    header_tensor,
    iter_chunks,
    tensor_spec,
    tensor_to_array,
)
from onnxps.wire.encoding import DeferredEncoding, compiled_codec

Array = np.ndarray[Any, Any]
BF16 = ml_dtypes.bfloat16


def test_the_codec_path_is_the_one_asked_for(kernels: str) -> None:
    loops = compiled_codec()
    assert (loops is not None) == (kernels == "numba")
    if loops is not None:
        assert sorted(loops) == ["bfloat16", "float16", "widen_float16"]


@pytest.mark.skipif(not HAVE_NUMBA, reason=NO_NUMBA)
def test_the_compiled_loops_give_the_numpy_paths_bits() -> None:
    loops = _codec_numba.load()
    rng = np.random.default_rng(17)
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    specials = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFBFFFFF,
                0x7F7FFFFF, 0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001,
                0x387FFFFF, 0x38800000, 0x00000001, 0x7F7F8000, 0x7F7F7FFF]  # fmt: skip
    bits = np.concatenate([np.array(specials, np.uint32), bits])
    x = bits.view(np.float32)
    n = bits.size
    scratch = [np.empty(n, np.uint32) for _ in range(3)]
    mask = np.empty(n, np.bool_)
    for name, numpy_path, inf in (
        ("bfloat16", _encoding._bfloat16, 0x7F80),
        ("float16", _encoding._float16, 0x7C00),
    ):
        want = np.empty(n, np.uint16)
        numpy_path(x, want, scratch, mask)
        got = np.empty(n, np.uint16)
        assert loops[name](bits, got)  # the specials hold finite overflows
        np.testing.assert_array_equal(got, want)
        finite = ((want & 0x7FFF) != inf) | ~np.isfinite(x)
        assert not loops[name](bits[finite], got[: int(finite.sum())])
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want32 = np.empty(1 << 16, np.uint32)
    _encoding._float16_bits(
        every, want32, [np.empty(1 << 16, np.uint32) for _ in range(3)],
        np.empty(1 << 16, np.bool_),
    )  # fmt: skip
    got32 = np.empty(1 << 16, np.uint32)
    loops["widen_float16"](every, got32)
    np.testing.assert_array_equal(got32, want32)


def bits16(encoded: Array) -> Array:
    return encoded.reshape(-1).view(np.uint16)


def f32_from_bits(*bits: int) -> Array:
    return np.array(bits, dtype=np.uint32).view(np.float32)


# -- bfloat16 of float32 -------------------------------------------------------------
def test_bfloat16_of_random_float32_bit_patterns_equals_ml_dtypes() -> None:
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    x = x.view(np.float32)
    magnitude = x.view(np.uint32) & 0x7FFFFFFF
    x = x[(magnitude < 0x7F7F8000) | (magnitude >= 0x7F800000)]  # no finite overflow
    x = x[~np.isnan(x)]
    got = bits16(encode(x, "bfloat16"))
    np.testing.assert_array_equal(got, x.astype(BF16).view(np.uint16))
    assert np.array_equal(decode(encode(x, "bfloat16")), x.astype(BF16).astype("f4"))


def test_bfloat16_ties_round_to_even_both_ways_and_both_signs() -> None:
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (mantissa ...0): down to 1.
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up to 1 + 2^-6.
    x = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8), 1 + 2**-8 + 2**-20],
        np.float32,
    )
    assert decode(encode(x, "bfloat16")).tolist() == [
        1.0,
        1 + 2**-6,
        -1.0,
        -(1 + 2**-6),
        1 + 2**-7,  # above the tie: up
    ]


def test_bfloat16_subnormals_zeros_and_infinities() -> None:
    x = f32_from_bits(
        0x00000001,  # the smallest float32 subnormal: below half of bfloat16's
        0x80000001,  # the same, negative: -0.0
        0x00010000,  # bfloat16's smallest subnormal, 2^-133
        0x00018000,  # 1.5 * 2^-133: a tie, to even (2 * 2^-133)
        0x00008000,  # 0.5 * 2^-133: a tie, to even (0)
        0x00000000,
        0x80000000,  # -0.0 keeps its sign
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x7F7F7FFF,  # below the overflow threshold: bfloat16's largest
    )
    got = bits16(encode(x, "bfloat16")).tolist()
    assert got == [
        0x0000,
        0x8000,
        0x0001,
        0x0002,
        0x0000,
        0x0000,
        0x8000,
        0x7F80,
        0xFF80,
        0x7F7F,
    ]


def test_bfloat16_keeps_every_nan_a_nan_with_its_sign() -> None:
    # Payloads in the low bits only would round to inf, and 0xFFFFFFFF would wrap.
    x = f32_from_bits(0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF)
    got = bits16(encode(x, "bfloat16"))
    widened = decode(encode(x, "bfloat16"))
    assert np.isnan(widened).all()
    assert ((got & 0x7F80) == 0x7F80).all() and ((got & 0x007F) != 0).all()
    assert np.signbit(widened).tolist() == [False, False, False, True, True]


# 0x7F7F8000: the tie between bfloat16's largest and 2^128, the first to overflow
@pytest.mark.parametrize(
    "value", [3.4028235e38, -3.4e38, float(f32_from_bits(0x7F7F8000)[0])]
)
def test_bfloat16_refuses_a_finite_value_that_would_become_inf(value: float) -> None:
    x = np.zeros(70_000, np.float32)  # past the first block
    x[66_000] = value
    with pytest.raises(EncodingRangeError) as err:
        encode(x, "bfloat16", "gradient 2")
    msg = str(err.value)
    assert "gradient 2" in msg and "element 66000" in msg and "bfloat16" in msg
    assert "3.3895e+38" in msg and "native" in msg
    assert isinstance(err.value, ValueError)


# -- bfloat16 of float64: one correct rounding --------------------------------------
def _bf16_values() -> Array:
    """Every finite non-negative bfloat16 value, as float64, in order."""
    b = np.arange(0x0000, 0x7F80, dtype=np.uint16).view(BF16)
    values: Array = b.astype(np.float64)
    return values


def _nearest_even_bf16(x: float, grid: Array) -> float:
    """bfloat16(x), rounded to nearest with ties to even, exactly (Fraction)."""
    mag = abs(x)
    i = int(np.searchsorted(grid, mag))
    lo, hi = grid[max(0, i - 1)], grid[min(i, len(grid) - 1)]
    if grid[min(i, len(grid) - 1)] == mag:
        lo = hi = mag
    d_lo, d_hi = Fraction(mag) - Fraction(lo), Fraction(hi) - Fraction(mag)
    if d_lo < d_hi:
        r = lo
    elif d_hi < d_lo:
        r = hi
    else:  # a tie: the even mantissa
        r = lo if int(np.float32(lo).view(np.uint32) >> 16) % 2 == 0 else hi
    return float(np.copysign(r, x))


def test_bfloat16_of_float64_is_rounded_once_not_twice() -> None:
    # Just above the tie between 1 and 1 + 2^-7: float64 -> float32 -> bfloat16
    # rounds to 1.0 (the float32 is the tie itself); the correct answer is up.
    x = np.array([1 + 2**-8 + 2**-40, -(1 + 2**-8 + 2**-40)])
    assert decode(encode(x, "bfloat16")).tolist() == [1 + 2**-7, -(1 + 2**-7)]
    assert x.astype(np.float32).astype(BF16).astype(np.float64)[0] == 1.0


def test_bfloat16_of_float64_equals_the_exact_oracle() -> None:
    rng = np.random.default_rng(11)
    grid = _bf16_values()
    ties = grid[1000:40000:97] + np.diff(grid)[1000:40000:97] / 2  # exact ties
    near = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf)])
    x = np.concatenate(
        [
            near,
            -near,
            rng.standard_normal(2000) * 10.0 ** rng.integers(-40, 38, 2000),
            [2.0**-140, 2.0**-134 * 3, 1e-50, -1e-50, 0.0, -0.0],
        ]
    )
    got = decode(encode(x, "bfloat16"))
    assert got.dtype == np.float64
    expected = [_nearest_even_bf16(float(v), grid) for v in x]
    mismatches = [(v, g, e) for v, g, e in zip(x, got, expected, strict=True) if g != e]
    assert not mismatches, mismatches[:5]
    assert np.signbit(got).tolist() == np.signbit(x).tolist()


def test_bfloat16_of_float64_refuses_values_beyond_its_range() -> None:
    with pytest.raises(EncodingRangeError, match="1e\\+39"):
        encode(np.array([1.0, 1e39]), "bfloat16")
    assert np.isinf(decode(encode(np.array([np.inf, -np.inf]), "bfloat16"))).all()
    assert np.isnan(decode(encode(np.array([np.nan]), "bfloat16"))).all()


# -- float16 -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float16_rounds_as_ieee_binary16(dtype: Any) -> None:
    x = np.array(
        [
            1 + 2**-11,  # a tie: to even, 1
            1 + 3 * 2**-11,  # a tie: to even, 1 + 2^-9
            2.0**-24,  # the smallest subnormal
            2.0**-25,  # half of it: a tie, to 0
            -(2.0**-26),  # -0.0
            65504.0,
            65519.0,  # rounds down to 65504
            -0.0,
            np.inf,
            np.nan,
        ],
        dtype,
    )
    got = decode(encode(x, "float16"))
    assert got.dtype == dtype
    expected = [1.0, 1 + 2**-9, 2.0**-24, 0.0, -0.0, 65504.0, 65504.0, -0.0, np.inf]
    assert got[:-1].tolist() == expected
    assert np.signbit(got[:-1]).tolist() == np.signbit(expected).tolist()
    assert np.isnan(got[-1])


def test_float16_of_random_float32_bit_patterns_equals_numpy() -> None:
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate(
        [bits, np.arange(0x33000000, 0x33800000, 97, dtype=np.uint32)]
    )
    x = bits.view(np.float32)
    x = x[~(np.isfinite(x) & (np.abs(x) >= 65520))]  # no finite overflow
    got = bits16(encode(x, "float16"))
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()
    assert (np.signbit(got[nan].view(np.float16)) == np.signbit(x[nan])).all()


def test_float16_of_random_float64_equals_numpy_direct_rounding() -> None:
    rng = np.random.default_rng(5)
    halves = np.arange(0, 0x7BFF, dtype=np.uint16).view(np.float16).astype("f8")
    ties = (halves[:-1] + halves[1:]) / 2  # exact in float64
    x = np.concatenate(
        [
            ties,
            np.nextafter(ties, 0),
            np.nextafter(ties, np.inf),
            rng.standard_normal(20_000) * 10.0 ** rng.integers(-12, 5, 20_000),
        ]
    )
    x = np.concatenate([x, -x])
    np.testing.assert_array_equal(
        bits16(encode(x, "float16")), x.astype(np.float16).view(np.uint16)
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_float16_and_bfloat16_value_widens_exactly(dtype: Any) -> None:
    every = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        bf16 = every.view(BF16).astype(np.float32).astype(dtype)
    for enc, expected in (
        ("float16", every.view(np.float16).astype(dtype)),
        ("bfloat16", bf16),
    ):
        t = pb.Tensor(
            dtype=pb.DATA_TYPE_FLOAT if dtype == np.float32 else pb.DATA_TYPE_DOUBLE,
            dims=[1 << 16],
            raw_data=every.astype("<u2").tobytes(),
            encoding=pb.ENCODING_FLOAT16 if enc == "float16" else pb.ENCODING_BFLOAT16,
        )
        got = tensor_to_array(t, encoded=True)
        assert got.dtype == dtype
        nan = np.isnan(expected)
        assert got[~nan].tobytes() == expected[~nan].tobytes(), enc
        assert np.isnan(got[nan]).all()
        assert (np.signbit(got[nan]) == np.signbit(expected[nan])).all()


def test_float16_of_float64_is_rounded_once() -> None:
    x = np.array([1 + 2**-11 + 2**-40])  # just above the tie: up
    assert decode(encode(x, "float16")).tolist() == [1 + 2**-10]


@pytest.mark.parametrize("value", [65520.0, -70000.0, 1e30])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float16_refuses_a_finite_value_that_would_become_inf(
    value: float, dtype: type
) -> None:
    x: Array = np.ones(10, dtype)
    x[7] = value
    with pytest.raises(EncodingRangeError) as err:
        encode(x, "float16", "gradient 1")
    msg = str(err.value)
    assert "element 7" in msg and "65504" in msg and "bfloat16" in msg


def test_encoding_needs_a_float32_or_float64_array() -> None:
    for bad in (np.arange(3), np.ones(3, np.float16)):
        with pytest.raises(TypeError, match="float32 and float64"):
            encode(bad, "bfloat16", "gradient 1")
    native = np.arange(3.0)
    assert encode(native, "native") is native


# -- tensor messages and chunks ------------------------------------------------------
@pytest.mark.parametrize("encoding", ["bfloat16", "float16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encoded_tensor_message_is_two_bytes_per_element_and_widens(
    encoding: str, dtype: type
) -> None:
    x: Array = np.random.default_rng(1).standard_normal((3, 5)).astype(dtype)
    e = encode(x, encoding)
    assert e.shape == (3, 5) and e.nbytes == 30 and ENCODED[e.dtype][0] == dtype
    t = array_to_tensor(e, "w")
    code = pb.ENCODING_BFLOAT16 if encoding == "bfloat16" else pb.ENCODING_FLOAT16
    assert (t.encoding, t.dtype, list(t.dims), len(t.raw_data)) == (
        code,
        pb.DATA_TYPE_FLOAT if dtype == np.float32 else pb.DATA_TYPE_DOUBLE,
        [3, 5],
        30,
    )
    assert t.raw_data == bits16(e).astype("<u2").tobytes()
    got = tensor_to_array(t, "w", encoded=True)
    assert got.dtype == dtype and got.tobytes() == decode(e).tobytes()
    # 0-d
    s = array_to_tensor(encode(np.array(1.5, dtype), encoding))
    assert tensor_to_array(s, encoded=True).shape == ()


def test_encoded_tensor_is_refused_where_tensors_travel_native() -> None:
    t = array_to_tensor(encode(np.ones(4, np.float32), "bfloat16"), "w")
    with pytest.raises(TensorFormatError, match="only gradients .* travel encoded"):
        tensor_to_array(t, "tensor 'w'")
    t.encoding = 9  # type: ignore[assignment]
    with pytest.raises(TensorFormatError, match="encoding 9: expected"):
        tensor_spec(t, "gradient 1", encoded=True)
    ints = pb.Tensor(dtype=pb.DATA_TYPE_INT64, dims=[2], encoding=pb.ENCODING_FLOAT16)
    with pytest.raises(TensorFormatError, match="FLOAT and DOUBLE tensors only"):
        tensor_spec(ints, "indices", encoded=True)


def test_encoded_tensor_with_the_wrong_byte_count_is_refused() -> None:
    t = array_to_tensor(encode(np.ones(4, np.float32), "float16"), "w")
    t.raw_data = t.raw_data[:7]
    with pytest.raises(TensorFormatError) as err:
        tensor_to_array(t, "gradient 1", encoded=True)
    assert "encoded as float16, which is 8 bytes, but carries 7 bytes" in str(err.value)
    t.raw_data = np.ones(4, np.float32).tobytes()  # native bytes, encoding set
    with pytest.raises(TensorFormatError, match="8 bytes, but carries 16 bytes"):
        tensor_to_array(t, "gradient 1", encoded=True)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 64])
def test_encoded_chunks_hold_whole_elements_and_assemble(chunk_bytes: int) -> None:
    x = np.random.default_rng(2).standard_normal(101)
    e = encode(x, "bfloat16")
    chunks = list(iter_chunks([e, x], chunk_bytes))
    encoded_chunks = [c for c in chunks if c.index == 0]
    assert all(len(c.data) % 2 == 0 for c in encoded_chunks)
    assert sum(len(c.data) for c in encoded_chunks) == 202
    msgs = list(chunk_messages(pb.PushStreamRequest, [e], chunk_bytes))
    assert [m.chunk.data for m in msgs] == [c.data for c in encoded_chunks]
    asm = TensorAssembler(
        [header_tensor(e), header_tensor(x)], ["g1", "g2"], encoded=True
    )
    for c in chunks:
        asm.add(c)
    got, native = asm.finish()
    assert got.tobytes() == decode(e).tobytes() and native.tobytes() == x.tobytes()


def test_assembler_refuses_odd_short_long_and_unexpected_encoded_chunks() -> None:
    e = encode(np.ones(8, np.float32), "bfloat16")
    h = header_tensor(e)

    def asm() -> TensorAssembler:
        return TensorAssembler([h], ["gradient 1"], encoded=True)

    a = asm()
    with pytest.raises(TensorFormatError) as err:
        a.add(pb.TensorChunk(index=0, offset=0, data=b"\x00" * 3))
    assert "carries 3 bytes encoded as bfloat16" in str(err.value)
    assert "whole 2-byte elements" in str(err.value)
    a = asm()
    with pytest.raises(TensorFormatError, match="is 16 bytes encoded as bfloat16, but"):
        a.add(pb.TensorChunk(index=0, offset=0, data=b"\x00" * 18))
    a = asm()
    a.add(pb.TensorChunk(index=0, offset=0, data=b"\x00" * 10))
    with pytest.raises(TensorFormatError, match="10 of 16 bytes encoded as bfloat16"):
        a.finish()
    with pytest.raises(TensorFormatError, match="only gradients"):
        TensorAssembler([h], ["tensor 'w'"])


@pytest.mark.parametrize("encoding", ["bfloat16", "float16"])
def test_signalling_nans_of_float64_stay_nan_without_a_warning(encoding: str) -> None:
    # pytest turns warnings into errors: NumPy warns when a cast meets one
    bits = [0x7FF0000000000001, 0xFFF0000000000001, 0x7FF8000000000000]
    x = np.array(bits, np.uint64).view(np.float64)
    got = decode(encode(x, encoding))
    assert np.isnan(got).all() and np.signbit(got).tolist() == [False, True, False]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("encoding", ["bfloat16", "float16"])
def test_deferred_encoding_block_by_block_equals_encode(
    kernels: str, encoding: str, dtype: type
) -> None:
    x: Array = np.random.default_rng(9).standard_normal(200_003).astype(dtype)
    deferred = DeferredEncoding(x, encoding, "gradient 3")
    whole = encode(x, encoding, "gradient 3")
    assert (deferred.shape, deferred.dtype, deferred.nbytes) == (
        whole.shape, whole.dtype, whole.nbytes,
    )  # fmt: skip
    np.testing.assert_array_equal(
        deferred.encoded().view(np.uint16), whole.view(np.uint16)
    )
    sizes = []
    parts = []
    for block in deferred.blocks(65_536):
        sizes.append(block.size)
        parts.append(block.copy())  # the buffer is reused for the next block
    assert sizes == [65_536, 65_536, 65_536, 3_395]
    np.testing.assert_array_equal(np.concatenate(parts), whole.view(np.uint16))
    # an overflow in a later block names its element in the whole tensor
    x[150_001] = 1e300 if dtype is np.float64 else 3.4e38
    if encoding == "float16":
        x[150_001] = 70_000.0
    blocks = DeferredEncoding(x, encoding, "gradient 3").blocks(65_536)
    next(blocks)
    next(blocks)  # elements 0..131071 are fine
    with pytest.raises(
        EncodingRangeError, match=r"gradient 3 holds .* \(element 150001\)"
    ):
        next(blocks)
    with pytest.raises(TypeError, match="float32 and float64"):
        DeferredEncoding(np.arange(5), encoding)
