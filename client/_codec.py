"""Tensors on the wire: ndarray <-> ``onnxps.v1.Tensor``, and chunked streams.

Bytes travel raw, little-endian, C order. Reading a protobuf bytes field copies, so a
field is read once and wrapped with ``np.frombuffer``. Both ends use this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ._errors import OnnxpsError

__all__ = [
    "CHUNK_BYTES",
    "DTYPE_TO_PROTO",
    "PROTO_TO_DTYPE",
    "TensorAssembler",
    "TensorFormatError",
    "array_to_tensor",
    "declared_nbytes",
    "header_tensor",
    "iter_chunks",
    "tensor_spec",
    "tensor_to_array",
    "write_tensor",
]

CHUNK_BYTES = 1 << 20

Array = np.ndarray[Any, Any]

DTYPE_TO_PROTO: dict[np.dtype[Any], int] = {
    np.dtype("<f4"): pb.FLOAT,
    np.dtype("<f8"): pb.DOUBLE,
    np.dtype("<i8"): pb.INT64,
}
PROTO_TO_DTYPE: dict[int, np.dtype[Any]] = {v: k for k, v in DTYPE_TO_PROTO.items()}
_NAMES = {pb.FLOAT: "FLOAT (float32)", pb.DOUBLE: "DOUBLE (float64)", pb.INT64: "INT64"}


class TensorFormatError(OnnxpsError, ValueError):
    """A tensor message that does not describe a valid tensor (dtype, dims, bytes)."""


def _wire_dtype(dtype: np.dtype[Any]) -> int:
    code = DTYPE_TO_PROTO.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise TensorFormatError(
            f"dtype {np.dtype(dtype)} cannot travel: expected float32, float64 "
            "(tensors, R) or int64 (T)"
        )
    return code


def tensor_spec(
    t: pb.Tensor, what: str = "tensor"
) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape a tensor message declares, validated."""
    dtype = PROTO_TO_DTYPE.get(t.dtype)
    if dtype is None:
        raise TensorFormatError(
            f"{what} has data type {t.dtype}: expected FLOAT (1), DOUBLE (11) or "
            "INT64 (7), numbered as ONNX TensorProto.DataType"
        )
    dims = tuple(int(d) for d in t.dims)
    if any(d < 0 for d in dims):
        raise TensorFormatError(f"{what} has negative dims {list(dims)}")
    return dtype, dims


def declared_nbytes(t: pb.Tensor, what: str = "tensor") -> int:
    dtype, dims = tensor_spec(t, what)
    return math.prod(dims) * dtype.itemsize


def write_tensor(msg: pb.Tensor, a: Any, name: str = "") -> pb.Tensor:
    """Fill ``msg`` (e.g. ``request.gradients.add()``) with a tensor, bytes inline.

    Filling the message in place, rather than building one and appending it, saves
    a copy of the bytes: protobuf copies a message when it is appended or nested.
    """
    arr = np.asarray(a)
    code = _wire_dtype(arr.dtype)
    arr = np.asarray(arr, dtype=PROTO_TO_DTYPE[code], order="C")  # keeps 0-d
    msg.name = name
    msg.dtype = code  # type: ignore[assignment]
    msg.dims[:] = arr.shape
    msg.raw_data = arr.tobytes(order="C")
    return msg


def array_to_tensor(a: Any, name: str = "") -> pb.Tensor:
    """One tensor message with its bytes inline (unary calls)."""
    return write_tensor(pb.Tensor(), a, name)


def header_tensor(a: Any, name: str = "") -> pb.Tensor:
    """A tensor message without bytes: the header of a stream."""
    arr = np.asarray(a)
    return pb.Tensor(name=name, dtype=_wire_dtype(arr.dtype), dims=arr.shape)


def tensor_to_array(t: pb.Tensor, what: str = "tensor") -> Array:
    """A read-only array over the message's bytes, after checking their length."""
    dtype, dims = tensor_spec(t, what)
    raw = t.raw_data  # read the field once: each read copies
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise TensorFormatError(
            f"{what} declares {dtype.name} dims {list(dims)}, which is {expected} "
            f"bytes, but carries {len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(dims)


def iter_chunks(
    arrays: Iterable[Any], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    """The bytes of ``arrays`` in order, as ~chunk_bytes TensorChunk messages."""
    for index, a in enumerate(arrays):
        arr = np.asarray(a)
        arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")
        view = memoryview(arr.reshape(-1)).cast("B")  # type: ignore[arg-type]
        for start in range(0, len(view), chunk_bytes):
            yield pb.TensorChunk(
                index=index, offset=start, data=bytes(view[start : start + chunk_bytes])
            )


class TensorAssembler:
    """Fills preallocated arrays from a stream's chunks, checking every offset."""

    def __init__(self, headers: Sequence[pb.Tensor], names: Sequence[str]) -> None:
        self.names = list(names)
        self.arrays: list[Array] = []
        for t, what in zip(headers, self.names, strict=True):
            dtype, dims = tensor_spec(t, what)
            self.arrays.append(np.empty(dims, dtype=dtype))
        self._views = [
            memoryview(a.reshape(-1)).cast("B")  # type: ignore[arg-type]
            for a in self.arrays
        ]
        self._filled = [0] * len(self.arrays)

    def add(self, chunk: pb.TensorChunk) -> None:
        i = chunk.index
        if i >= len(self.arrays):
            raise TensorFormatError(
                f"chunk for tensor index {i}, but the header lists "
                f"{len(self.arrays)} tensors"
            )
        data = chunk.data
        view = self._views[i]
        if chunk.offset != self._filled[i]:
            raise TensorFormatError(
                f"chunk of {self.names[i]} at byte offset {chunk.offset}, expected "
                f"offset {self._filled[i]} (chunks of a tensor arrive in order)"
            )
        end = chunk.offset + len(data)
        if end > len(view):
            raise TensorFormatError(
                f"{self.names[i]} is {len(view)} bytes, but chunks reach byte {end}"
            )
        view[chunk.offset : end] = data
        self._filled[i] = end

    def finish(self) -> list[Array]:
        for i, view in enumerate(self._views):
            if self._filled[i] != len(view):
                raise TensorFormatError(
                    f"stream ended with {self.names[i]} incomplete: {self._filled[i]} "
                    f"of {len(view)} bytes received"
                )
        return self.arrays
