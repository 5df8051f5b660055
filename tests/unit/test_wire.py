"""The one tensor codec: public, complete, shared by both ends, and its error type."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import onnxps.wire.codec as codec
import pytest
from onnxps.client import OnnxpsError, TensorFormatError
from onnxps.v1 import parameter_server_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def test_codec_all_is_complete_and_sorted() -> None:
    defined = {
        name
        for name, value in vars(codec).items()
        if not name.startswith("_")
        and getattr(value, "__module__", codec.__name__) == codec.__name__
        and (callable(value) or name.isupper())
    }
    assert defined <= set(codec.__all__), defined - set(codec.__all__)
    assert codec.__all__ == sorted(codec.__all__)
    for name in codec.__all__:
        assert hasattr(codec, name), name


def test_the_server_imports_no_private_client_module() -> None:
    offenders = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["onnxps", "client"] and any(
                    p.startswith("_") for p in parts[2:]
                ):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []


def test_service_name_comes_from_the_descriptor() -> None:
    from onnxps.server.interceptors._handlers import SERVICE

    (service,) = pb.DESCRIPTOR.services_by_name.values()
    assert codec.SERVICE == SERVICE == service.full_name
    assert SERVICE == "onnxps.v1.ParameterServerService"


def test_tensor_format_error_is_the_clients_error_and_a_value_error() -> None:
    with pytest.raises(TensorFormatError) as err:
        codec.tensor_to_array(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[2]), "g")
    assert isinstance(err.value, OnnxpsError) and isinstance(err.value, ValueError)
    assert "declares float32 dims [2], which is 8 bytes, but carries 0" in str(
        err.value
    )


@pytest.mark.parametrize(
    "message", [pb.PushStreamRequest, pb.PullStreamResponse, pb.ApplyStreamResponse]
)
def test_chunk_messages_cover_every_byte_in_order(message: Any) -> None:
    a = np.arange(10, dtype=np.float64)
    b = np.float32(2.5)
    msgs = list(codec.chunk_messages(message, [a, b], 24))
    assert [(m.chunk.index, m.chunk.offset, len(m.chunk.data)) for m in msgs] == [
        (0, 0, 24),
        (0, 24, 24),
        (0, 48, 24),
        (0, 72, 8),
        (1, 0, 4),
    ]
    asm = codec.TensorAssembler(
        [codec.header_tensor(a), codec.header_tensor(b)], ["a", "b"]
    )
    for m in msgs:
        asm.add(m.chunk)
    out_a, out_b = asm.finish()
    assert out_a.tobytes() == a.tobytes() and out_b.shape == () and out_b == b


def test_a_chunk_out_of_order_is_refused() -> None:
    asm = codec.TensorAssembler([codec.header_tensor(np.zeros(4, "f4"))], ["w"])
    with pytest.raises(TensorFormatError, match="expected offset 0"):
        asm.add(pb.TensorChunk(index=0, offset=8, data=b"1234"))


def test_dims_numpy_cannot_hold_are_a_format_error() -> None:
    huge = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[0, 2**31, 2**31])
    with pytest.raises(TensorFormatError, match=r"dims \[0, 2147483648, 2147483648\]"):
        codec.TensorAssembler([huge], ["w"])


def test_a_segment_layout_packs_one_dtype_back_to_back() -> None:
    from onnxps.wire.shm import layout, one_itemsize

    f32 = np.dtype(np.float32)
    assert layout([132, 4000, 8]) == ([64, 256, 4288], 4352)  # 64-byte aligned
    assert layout([132, 4000, 8], 4) == ([64, 196, 4196], 4204)  # back to back
    assert one_itemsize([f32, f32]) == 4
    assert one_itemsize([f32, np.dtype(np.float64)]) is None
    assert one_itemsize([]) is None


def test_a_segment_is_sized_within_a_sixteenth_of_its_tensors() -> None:
    """The pool's size classes: the server maps a segment whole, so a 128 MiB
    group in a segment rounded up to a power of two cost twice its bytes."""
    from onnxps.client.shm import SegmentPool, size_class

    assert size_class(100) == 64 << 10
    assert size_class((128 << 20) + 64) == 136 << 20  # not 256 MiB
    for need in (65 << 10, 1_000_003, (1 << 30) + 1, 7 << 20):
        assert need <= size_class(need) <= need * 1.0625
    pool = SegmentPool()
    try:
        seg = pool.acquire([4 << 20])
        assert seg.size == size_class((4 << 20) + 64) == (4 << 20) + (256 << 10)
        pool.release(seg)
        again = pool.acquire([(4 << 20) - 1000])  # 1/16 smaller: reused
        pool.release(again)
        assert again is seg
    finally:
        pool.close()


def test_header_tensors_are_made_once_per_shape_and_copied_into_messages() -> None:
    """A group's calls send the same headers: ``header_tensors`` makes them once
    for arrays of these dtypes, shapes and names, and a message's ``extend``
    copies them (a message changed after leaves the shared ones alone)."""
    arrays = [np.zeros((3, 2), np.float32), np.zeros(5, np.float32)]
    first = codec.header_tensors(arrays, ["w", "b"])
    assert first == [
        codec.header_tensor(a, n) for a, n in zip(arrays, "wb", strict=True)
    ]
    again = codec.header_tensors(
        [np.ones((3, 2), np.float32), np.ones(5, np.float32)], ["w", "b"]
    )
    assert again is first  # the same dtypes, shapes and names: the same messages
    assert codec.header_tensors(arrays) is not first  # other names (none)
    assert codec.header_tensors(arrays)[0].name == ""
    other = codec.header_tensors([np.zeros(5, np.float64)], ["b"])
    assert other[0].dtype == pb.DATA_TYPE_DOUBLE and list(other[0].dims) == [5]
    reply = pb.PullResponse()
    reply.tensors.extend(first)
    reply.tensors[0].dims[0] = 7
    assert list(first[0].dims) == [3, 2]
    # not arrays (a deferred encoding, a list): made each time, as header_tensor
    listed = codec.header_tensors([[1.0, 2.0]], ["x"])
    assert listed[0].dtype == pb.DATA_TYPE_DOUBLE and listed[0].name == "x"
    assert codec.header_tensors([[1.0, 2.0]], ["x"]) is not listed
