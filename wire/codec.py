"""Tensors on the wire: ndarray <-> ``onnxps.v1.Tensor``, and chunked streams.

The one codec both ends use (the server imports it too). Bytes travel raw,
little-endian, C order; a 0-d tensor has no dims and one element. Reading a protobuf
bytes field copies, so a field is read once and wrapped with ``np.frombuffer``.

A stream carries a header (the tensors without bytes) and then stream messages whose
``chunk`` field holds the next ~1 MiB of one tensor, tensors in header order and
each tensor's chunks in offset order (``chunk_messages`` writes them,
``TensorAssembler`` reads them back and checks every offset).

A FLOAT or DOUBLE tensor may travel encoded in 2 bytes per element (``Tensor.encoding``:
bfloat16 or float16, see ``encoding``) where the reader allows it (``encoded=True``:
gradients, pulled X); the reader widens it to its dtype as it arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from google.protobuf.message import Message
from onnxps.v1 import parameter_server_pb2 as pb

from .encoding import (
    ENCODED,
    ENCODING_NAMES,
    DeferredEncoding,
    EncodingRangeError,
    decode,
    encode,
    widen_into,
)
from .errors import OnnxpsError

__all__ = [
    "CHUNK_BYTES",
    "DTYPE_TO_PROTO",
    "DeferredEncoding",
    "ENCODED",
    "ENCODING_NAMES",
    "EncodedMessage",
    "EncodingRangeError",
    "MAX_DIMS",
    "PROTO_TO_DTYPE",
    "RawChunk",
    "SERVICE",
    "SHARD_METADATA_KEY",
    "TensorAssembler",
    "TensorFormatError",
    "array_to_tensor",
    "check_carried",
    "chunk_frames",
    "chunk_messages",
    "declared_nbytes",
    "decode",
    "decode_chunk",
    "deserializer",
    "encode",
    "encode_chunk",
    "fill_flat",
    "frame_bytes",
    "header_tensor",
    "header_tensors",
    "iter_chunks",
    "rpc_messages",
    "serializer",
    "tensor_spec",
    "tensor_to_array",
    "tensors_to_arrays",
    "widen_into",
    "write_tensor",
]

CHUNK_BYTES = 1 << 20
MAX_DIMS = 64  # NumPy's limit on an array's number of dimensions

# The full name of the one service of the contract ("onnxps.v1.ParameterServerService"),
# from the descriptor: the client's service config, the server's health, reflection,
# metrics and auth all use this one value.
(_SERVICE_DESCRIPTOR,) = pb.DESCRIPTOR.services_by_name.values()
SERVICE: str = _SERVICE_DESCRIPTOR.full_name

# The metadata every call of a cluster client carries: "I/N", the shard index (from
# 0) it routed the call to and the shard count it routed for; a shard started with
# another identity refuses the call (docs/cluster.md).
SHARD_METADATA_KEY = "onnxps-shard"

Array = np.ndarray[Any, Any]

DTYPE_TO_PROTO: dict[np.dtype[Any], pb.DataType.ValueType] = {
    np.dtype("<f4"): pb.DATA_TYPE_FLOAT,
    np.dtype("<f8"): pb.DATA_TYPE_DOUBLE,
    np.dtype("<i8"): pb.DATA_TYPE_INT64,
}
PROTO_TO_DTYPE: dict[int, np.dtype[Any]] = {v: k for k, v in DTYPE_TO_PROTO.items()}
_NAMES = {
    pb.DATA_TYPE_FLOAT: "FLOAT (float32)",
    pb.DATA_TYPE_DOUBLE: "DOUBLE (float64)",
    pb.DATA_TYPE_INT64: "INT64",
}


class TensorFormatError(OnnxpsError, ValueError):
    """A tensor message that does not describe a valid tensor (dtype, dims, bytes)."""


def _wire_dtype(dtype: np.dtype[Any]) -> pb.DataType.ValueType:
    code = DTYPE_TO_PROTO.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise TensorFormatError(
            f"dtype {np.dtype(dtype)} cannot travel: expected float32, float64 "
            "(tensors, R) or int64 (T)"
        )
    return code


def tensor_spec(
    t: pb.Tensor, what: str = "tensor", *, encoded: bool = False
) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape a tensor message declares, validated; its encoding too,
    which is refused unless ``encoded`` (a gradient, or a pulled X)."""
    dtype = PROTO_TO_DTYPE.get(t.dtype)
    if dtype is None:
        raise TensorFormatError(
            f"{what} has data type {t.dtype}: expected FLOAT (1), DOUBLE (11) or "
            "INT64 (7), numbered as ONNX TensorProto.DataType"
        )
    if t.encoding:
        _check_encoding(t, dtype, what, encoded)
    dims = tuple(t.dims)  # ints: protobuf's int64 reads as int
    if len(dims) > MAX_DIMS:
        raise TensorFormatError(
            f"{what} has {len(dims)} dims: an array has at most {MAX_DIMS}"
        )
    if dims and min(dims) < 0:
        raise TensorFormatError(f"{what} has negative dims {list(dims)}")
    # NumPy must be able to address the array even when it holds no element: the
    # product of the nonzero dims, in bytes, stays below 2**63 (as for np.empty).
    size = math.prod(dims) or math.prod(d for d in dims if d)
    if size * dtype.itemsize >= 2**63:
        raise TensorFormatError(
            f"{what} has dims {list(dims)}: {dtype.name} dims whose nonzero product "
            "reaches 2**63 bytes describe no array"
        )
    return dtype, dims


def _check_encoding(
    t: pb.Tensor, dtype: np.dtype[Any], what: str, allowed: bool
) -> None:
    name = ENCODING_NAMES.get(t.encoding)
    if name is None:
        raise TensorFormatError(
            f"{what} has encoding {t.encoding}: expected ENCODING_UNSPECIFIED (0, "
            "native), ENCODING_BFLOAT16 (1) or ENCODING_FLOAT16 (2)"
        )
    if not allowed:
        raise TensorFormatError(
            f"{what} is encoded as {name}: only gradients (Push, PushStream, PushRows "
            "values) travel encoded; send this tensor native (encoding unset)"
        )
    if dtype.kind != "f":
        raise TensorFormatError(
            f"{what} is {_NAMES[t.dtype]} encoded as {name}: encodings apply to "
            "FLOAT and DOUBLE tensors only"
        )


def _wire_itemsize(t: pb.Tensor, dtype: np.dtype[Any]) -> int:
    return 2 if t.encoding else dtype.itemsize


def declared_nbytes(t: pb.Tensor, what: str = "tensor") -> int:
    """The bytes the tensor takes once read: its dtype's, whatever its encoding
    (an encoded tensor is widened; where encodings are allowed is checked when it is
    read)."""
    dtype, dims = tensor_spec(t, what, encoded=True)
    return math.prod(dims) * dtype.itemsize


def write_tensor(msg: pb.Tensor, a: Any, name: str = "") -> pb.Tensor:
    """Fill ``msg`` (e.g. ``request.gradients.add()``) with a tensor, bytes inline.

    Filling the message in place, rather than building one and appending it, saves
    a copy of the bytes: protobuf copies a message when it is appended or nested.
    """
    arr = np.asarray(a)
    code, encoding = _wire_type(arr.dtype)
    if not encoding:
        arr = np.asarray(arr, dtype=PROTO_TO_DTYPE[code], order="C")  # keeps 0-d
    msg.name = name
    msg.dtype = code
    msg.dims[:] = arr.shape
    msg.raw_data = arr.tobytes(order="C")
    if encoding:
        msg.encoding = encoding
    return msg


def _wire_type(
    dtype: np.dtype[Any],
) -> tuple[pb.DataType.ValueType, pb.Encoding.ValueType]:
    """The wire dtype and encoding of an array (an ENCODED one: its own)."""
    encoded = ENCODED.get(dtype)
    if encoded is not None:
        return DTYPE_TO_PROTO[encoded[0]], encoded[1]
    return _wire_dtype(dtype), pb.ENCODING_UNSPECIFIED


# -- many tensors in one message, encoded by hand ------------------------------------
# Filling a Tensor message from Python and serializing it costs ~8 us per tensor in
# upb (each field set, the bytes copied into the arena, then again on
# serialization), so a message of 200 small tensors spent more time there than in
# its bytes. A repeated Tensor field is written here instead, in the canonical
# encoding a protobuf library writes (fields in number order, dims packed, defaults
# left out), after the rest of the message as protobuf serializes it: parsers read
# the fields of a message in any order, and the elements of a repeated field in the
# order they come.


class EncodedMessage:
    """A protobuf message whose repeated Tensor field ``field`` holds ``arrays``,
    serialized once, here (one copy of the tensor bytes); gRPC's serializer sends
    ``SerializeToString()``. Reading the message's other fields reads ``message``
    (which has the tensor field empty).

    ``defer``: the bytes are joined when first serialized, not here, and
    ``parts()`` gives them unjoined (views of the arrays, which must not change
    meanwhile): a server's frame call sends a large pull's reply with no copy."""

    __slots__ = ("_parts", "_raw", "_size", "message")

    def __init__(
        self,
        message: Message,
        field: str,
        arrays: Sequence[Any],
        names: Sequence[str] | None = None,
        *,
        defer: bool = False,
    ) -> None:
        number = message.DESCRIPTOR.fields_by_name[field].number
        parts: list[Any] = [message.SerializeToString()]
        names = names if names is not None else [""] * len(arrays)
        for a, name in zip(arrays, names, strict=True):
            parts += _tensor_parts(number, a, name)
        self.message = message
        self._size = sum(memoryview(p).nbytes for p in parts)
        self._parts: list[Any] | None = parts if defer else None
        self._raw: bytes | None = None if defer else b"".join(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    @property
    def raw(self) -> bytes:
        if self._raw is None:
            self._raw = b"".join(self._parts or ())
            self._parts = None  # the arrays' views: dropped once joined
        return self._raw

    def parts(self) -> list[Any]:
        """The serialized message as pieces (bytes-like), joined or not."""
        return list(self._parts) if self._parts is not None else [self.raw]

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf spelling
        return self.raw

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf spelling
        return self._size


_SMALL_VARINTS = [bytes([v]) for v in range(0x80)]
_DIMS: dict[tuple[int, ...], bytes] = {}  # shape -> its packed dims field


def _packed_dims(shape: tuple[int, ...]) -> bytes:
    got = _DIMS.get(shape)
    if got is None:
        packed = b"".join(_varint(d) for d in shape)
        got = b"\x1a" + _varint(len(packed)) + packed if shape else b""
        if len(_DIMS) < 4096:
            _DIMS[shape] = got
    return got


def _tensor_parts(field: int, a: Any, name: str) -> list[Any]:
    """The wire bytes of ``Tensor`` element ``a`` of repeated field ``field``:
    what ``write_tensor`` and protobuf's serializer write, as a head and a view of
    the array's bytes."""
    arr = np.asarray(a)
    code = DTYPE_TO_PROTO.get(arr.dtype)  # little-endian, as bytes travel
    encoding: int = pb.ENCODING_UNSPECIFIED
    if code is None or not arr.flags.c_contiguous:
        code, encoding = _wire_type(arr.dtype)
        if not encoding:
            arr = np.asarray(arr, dtype=PROTO_TO_DTYPE[code], order="C")
    data: Any = b""
    if arr.size and encoding:  # an ENCODED dtype has no buffer format: as bytes
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    elif arr.size:
        data = memoryview(arr).cast("B")  # type: ignore[arg-type]
    head = b""
    if name:
        text = name.encode("utf-8")
        head = b"\x0a" + _varint(len(text)) + text
    if code:
        head += b"\x10" + _varint(code)
    head += _packed_dims(arr.shape)
    size = len(data) if isinstance(data, bytes) else data.nbytes
    if size:
        head += b"\x22" + _varint(size)
    tail = b"\x28" + _varint(encoding) if encoding else b""
    inner = len(head) + size + len(tail)
    return [_varint((field << 3) | 2) + _varint(inner) + head, data, tail]


def frame_bytes(
    arrays: Iterable[Any], block_elements: int = 1 << 19
) -> Iterator[memoryview]:
    """The bytes of a data channel frame's tensors, in order: each array's (an
    ENCODED dtype's too: viewed as bytes, having no buffer format of its own),
    and a ``DeferredEncoding``'s encoded ``block_elements`` at a time as they are
    asked for, so that encoding overlaps sending."""
    for a in arrays:
        if isinstance(a, DeferredEncoding):
            for block in a.blocks(block_elements):
                yield memoryview(block.view(np.uint8))  # type: ignore[arg-type]
        elif a.nbytes:
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            yield memoryview(flat)  # type: ignore[arg-type]


def array_to_tensor(a: Any, name: str = "") -> pb.Tensor:
    """One tensor message with its bytes inline (unary calls)."""
    return write_tensor(pb.Tensor(), a, name)


def header_tensor(a: Any, name: str = "") -> pb.Tensor:
    """A tensor message without bytes: the header of a stream (of an array, or
    of anything with an array's ``dtype`` and ``shape``)."""
    arr = a if isinstance(a, DeferredEncoding) else np.asarray(a)
    code, encoding = _wire_type(arr.dtype)
    return pb.Tensor(name=name, dtype=code, dims=arr.shape, encoding=encoding)


# The headers of the arrays of recent calls, by their dtypes, shapes and names: a
# group's calls send the same headers each time, and a Tensor message costs ~6 us
# to make from Python (1.2 ms for a group of 200 tensors) against ~0.7 us to copy.
_HEADERS: dict[tuple[Any, ...], list[pb.Tensor]] = {}
_HEADERS_KEPT = 64


def header_tensors(
    arrays: Sequence[Any], names: Sequence[str] | None = None
) -> list[pb.Tensor]:
    """``header_tensor`` of each of ``arrays`` (named ``names``), the messages
    shared with other calls of the same headers: copy them into a message
    (``extend``), never change them."""
    if not all(type(a) is np.ndarray for a in arrays):
        if names is None:
            return [header_tensor(a) for a in arrays]
        return [header_tensor(a, n) for a, n in zip(arrays, names, strict=True)]
    key = (
        tuple([(a.dtype, a.shape) for a in arrays]),
        None if names is None else tuple(names),
    )
    found = _HEADERS.get(key)
    if found is None:
        if names is None:
            found = [header_tensor(a) for a in arrays]
        else:
            found = [header_tensor(a, n) for a, n in zip(arrays, names, strict=True)]
        if len(_HEADERS) >= _HEADERS_KEPT:
            _HEADERS.clear()  # (one step: calls on other threads use it too)
        _HEADERS[key] = found
    return found


def tensor_to_array(
    t: pb.Tensor, what: str = "tensor", *, encoded: bool = False
) -> Array:
    """A read-only array over the message's bytes, after checking their length; an
    encoded tensor (allowed with ``encoded``) widened into a new array."""
    dtype, dims = tensor_spec(t, what, encoded=encoded)
    raw = _raw_data(t, dtype, dims, what)
    if not t.encoding:
        return np.frombuffer(raw, dtype=dtype).reshape(dims)
    out = np.empty(dims, dtype)
    widen_into(out.reshape(-1), raw, t.encoding)
    return out


def _raw_data(
    t: pb.Tensor, dtype: np.dtype[Any], dims: tuple[int, ...], what: str
) -> bytes:
    """The tensor's bytes (the field read once: each read copies), checked
    against its header."""
    raw = t.raw_data
    check_carried(t, dtype, dims, len(raw), what)
    return raw


def check_carried(
    t: pb.Tensor, dtype: np.dtype[Any], dims: tuple[int, ...], size: int, what: str
) -> None:
    """Refuse a tensor whose bytes (``size`` of them) are not what its header
    declares."""
    expected = math.prod(dims) * _wire_itemsize(t, dtype)
    if size != expected:
        encoding = f" encoded as {ENCODING_NAMES[t.encoding]}" if t.encoding else ""
        raise TensorFormatError(
            f"{what} declares {dtype.name} dims {list(dims)}{encoding}, which is "
            f"{expected} bytes, but carries {size} bytes"
        )


def _own_array(t: pb.Tensor, encoded: bool) -> Array:
    a = tensor_to_array(t, t.name, encoded=encoded)
    return a if t.encoding else a.copy()  # a widened one is new already


def tensors_to_arrays(
    tensors: Sequence[pb.Tensor], *, encoded: bool = False
) -> list[Array]:
    """Writable arrays of their own holding the tensors (each checked as
    ``tensor_to_array`` checks it, named by its ``name``): when they share a
    dtype, views of ONE new buffer they are copied into (one allocation however
    many tensors; the buffer lives while any of them does)."""
    if len(tensors) < 2:
        return [_own_array(t, encoded) for t in tensors]
    specs = [tensor_spec(t, t.name, encoded=encoded) for t in tensors]
    if len({d for d, _ in specs}) != 1:
        return [_own_array(t, encoded) for t in tensors]
    dtype = specs[0][0]
    sizes = [math.prod(dims) for _, dims in specs]
    flat = np.empty(sum(sizes), dtype)
    fill_flat(
        flat,
        (
            (_raw_data(t, dtype, dims, t.name), n, t.encoding)
            for t, (_, dims), n in zip(tensors, specs, sizes, strict=True)
        ),
    )
    out, pos = [], 0
    for (_, dims), n in zip(specs, sizes, strict=True):
        out.append(flat[pos : pos + n].reshape(dims))
        pos += n
    return out


def fill_flat(flat: Array, parts: Iterable[tuple[Any, int, int]]) -> None:
    """Write tensors' bytes one after the other into the 1-D array ``flat``:
    ``parts`` gives each one's raw bytes (checked already), element count and
    2-byte encoding (0: none; the bytes are copied as they are, else widened)."""
    flat_bytes = memoryview(flat).cast("B")  # type: ignore[arg-type]
    pos, item = 0, flat.itemsize
    for raw, n, encoding in parts:
        if encoding:
            widen_into(flat[pos : pos + n], raw, encoding)
        else:
            flat_bytes[pos * item : (pos + n) * item] = raw
        pos += n


def _byte_views(arrays: Iterable[Any]) -> Iterator[tuple[int, memoryview]]:
    for index, a in enumerate(arrays):
        arr = np.asarray(a)
        arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")
        yield index, memoryview(arr.reshape(-1)).cast("B")  # type: ignore[arg-type]


def _step(a: Any, chunk_bytes: int) -> int:
    """Chunk size for one array: an encoded one's chunks hold whole elements."""
    if np.asarray(a).dtype in ENCODED:
        return max(2, chunk_bytes - chunk_bytes % 2)
    return chunk_bytes


def iter_chunks(
    arrays: Iterable[Any], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    """The bytes of ``arrays`` in order, as ~chunk_bytes TensorChunk messages."""
    arrays = list(arrays)
    for index, view in _byte_views(arrays):
        step = _step(arrays[index], chunk_bytes)
        for start in range(0, len(view), step):
            yield pb.TensorChunk(
                index=index, offset=start, data=bytes(view[start : start + step])
            )


class _ChunkCarrier(Protocol):
    """A stream message (``PushStreamRequest``, ``PullStreamResponse``...)."""

    @property
    def chunk(self) -> pb.TensorChunk: ...


_M = TypeVar("_M", bound=_ChunkCarrier)


def chunk_messages(
    message: type[_M], arrays: Iterable[Any], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[_M]:
    """The bytes of ``arrays`` as stream messages of type ``message``, chunk set.

    The chunk is filled inside the stream message: building a ``TensorChunk`` and
    nesting it would copy its bytes once more.
    """
    arrays = list(arrays)
    for index, view in _byte_views(arrays):
        step = _step(arrays[index], chunk_bytes)
        for start in range(0, len(view), step):
            msg = message()
            chunk = msg.chunk
            chunk.index = index
            chunk.offset = start
            chunk.data = bytes(view[start : start + step])
            yield msg


class TensorAssembler:
    """Fills preallocated arrays from a stream's chunks, checking every offset.

    With ``encoded``, a tensor may arrive encoded (its header says how): each chunk
    is widened into its array as it arrives, so its chunks must hold whole elements.
    ``out`` gives arrays to fill instead of fresh ones (e.g. buffers reused from
    call to call): each is used where it is C-contiguous, writable and of its
    header's dtype and dims, and a fresh array is made otherwise.
    """

    def __init__(
        self,
        headers: Sequence[pb.Tensor],
        names: Sequence[str],
        *,
        encoded: bool = False,
        out: Sequence[Array] | None = None,
    ) -> None:
        self.names = list(names)
        self.arrays: list[Array] = []
        self._encodings: list[int] = []
        for k, (t, what) in enumerate(zip(headers, self.names, strict=True)):
            dtype, dims = tensor_spec(t, what, encoded=encoded)
            self._encodings.append(t.encoding)
            if out is not None and k < len(out) and _fits(out[k], dtype, dims):
                self.arrays.append(out[k])
                continue
            try:
                self.arrays.append(np.empty(dims, dtype=dtype))
            except ValueError as exc:  # dims whose product overflows, next to a 0
                raise TensorFormatError(
                    f"{what} has dims {list(dims)}: {exc}"
                ) from None
        self._views = [
            memoryview(a.reshape(-1)).cast("B")  # type: ignore[arg-type]
            for a in self.arrays
        ]
        # Bytes on the wire per tensor: half or a quarter of the array when encoded.
        self._sizes = [
            a.size * 2 if enc else a.nbytes
            for a, enc in zip(self.arrays, self._encodings, strict=True)
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
        if chunk.offset != self._filled[i]:
            raise TensorFormatError(
                f"chunk of {self.names[i]} at byte offset {chunk.offset}, expected "
                f"offset {self._filled[i]} (chunks of a tensor arrive in order)"
            )
        end = chunk.offset + len(data)
        if end > self._sizes[i]:
            raise TensorFormatError(
                f"{self.names[i]} is {self._sizes[i]} bytes{self._as(i)}, but chunks "
                f"reach byte {end}"
            )
        if self._encodings[i]:
            if len(data) % 2:
                raise TensorFormatError(
                    f"chunk of {self.names[i]} at byte offset {chunk.offset} carries "
                    f"{len(data)} bytes{self._as(i)}: the chunks of an encoded tensor "
                    "hold whole 2-byte elements (even lengths)"
                )
            flat = self.arrays[i].reshape(-1)
            widen_into(flat[chunk.offset // 2 : end // 2], data, self._encodings[i])
        else:
            self._views[i][chunk.offset : end] = data
        self._filled[i] = end

    def ready(self, i: int) -> int:
        """How many whole elements of tensor ``i`` have arrived (in order)."""
        per = 2 if self._encodings[i] else self.arrays[i].itemsize
        return self._filled[i] // per

    def _as(self, i: int) -> str:
        enc = self._encodings[i]
        return f" encoded as {ENCODING_NAMES[enc]}" if enc else ""

    def finish(self) -> list[Array]:
        for i, size in enumerate(self._sizes):
            if self._filled[i] != size:
                raise TensorFormatError(
                    f"stream ended with {self.names[i]} incomplete: {self._filled[i]} "
                    f"of {size} bytes{self._as(i)} received"
                )
        return self.arrays


def _fits(a: Array, dtype: np.dtype[Any], dims: Sequence[int]) -> bool:
    return (
        a.dtype == dtype
        and a.shape == tuple(dims)
        and a.flags.c_contiguous
        and a.flags.writeable
    )


# -- the chunk frames: a stream message whose ``chunk`` is set, by hand ----------------
# Protobuf costs three copies of every chunk's bytes on the way out (``bytes(view)``,
# the field's arena, ``SerializeToString``) and two on the way in (``FromString``, then
# each read of ``data``), each into freshly mapped memory. A frame is the same wire
# bytes (the canonical encoding a protobuf library writes) made with one copy from the
# array, and a received frame is read as a view of the bytes gRPC handed over. Any
# other message (the header, or a chunk encoded differently) goes through protobuf.


@dataclass(frozen=True)
class RawChunk:
    """A received ``TensorChunk`` whose ``data`` is a view of the frame it came in.

    It also stands for its stream message (``msg.chunk``, ``msg.WhichOneof``), so
    code written against the protobuf classes reads it unchanged.
    """

    index: int
    offset: int
    data: memoryview

    @property
    def chunk(self) -> RawChunk:
        return self

    def WhichOneof(self, name: str) -> str:  # noqa: N802 - the protobuf spelling
        return "chunk"


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return -1, pos  # truncated or too long


def _chunk_field(message: Any) -> int | None:
    """The field number of a stream message's ``chunk`` (None: it has none)."""
    field = message.DESCRIPTOR.fields_by_name.get("chunk")
    if field is None or field.message_type is not pb.TensorChunk.DESCRIPTOR:
        return None
    return int(field.number)


def encode_chunk(field: int, index: int, offset: int, data: Any) -> bytes:
    """The wire bytes of a stream message whose ``chunk`` (field ``field``) is
    ``TensorChunk(index, offset, data)``: one copy of ``data``."""
    inner = b""
    if index:
        inner += b"\x08" + _varint(index)
    if offset:
        inner += b"\x10" + _varint(offset)
    size = len(data)
    inner += b"\x1a" + _varint(size)
    head = _varint((field << 3) | 2) + _varint(len(inner) + size) + inner
    return b"".join((head, data))


def decode_chunk(raw: bytes, field: int) -> RawChunk | None:
    """The chunk of a frame in canonical form; None for anything else."""
    buf = memoryview(raw)
    end = len(buf)
    tag, pos = _read_varint(buf, 0, end)
    if tag != (field << 3) | 2:
        return None
    length, pos = _read_varint(buf, pos, end)
    if length < 0 or pos + length != end:
        return None
    index = offset = 0
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        if key == 0x08:
            index, pos = _read_varint(buf, pos, end)
            if not 0 <= index <= 0xFFFFFFFF:
                return None
        elif key == 0x10:
            offset, pos = _read_varint(buf, pos, end)
            if offset < 0:
                return None
        elif key == 0x1A:
            size, pos = _read_varint(buf, pos, end)
            if size < 0 or pos + size != end:
                return None
            return RawChunk(index, offset, buf[pos:end])
        else:
            return None
    return None


def chunk_frames(
    message: Any, arrays: Iterable[Any], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """The bytes of ``arrays`` as encoded stream messages of type ``message`` (what
    ``chunk_messages`` yields, serialized): send them with ``serializer``."""
    field = _chunk_field(message)
    assert field is not None, f"{message.DESCRIPTOR.name} carries no chunk"
    arrays = list(arrays)
    for index, view in _byte_views(arrays):
        step = _step(arrays[index], chunk_bytes)
        for start in range(0, len(view), step):
            yield encode_chunk(field, index, start, view[start : start + step])


def serializer(message: Any) -> Callable[[Any], bytes]:
    """gRPC's serializer for ``message``: bytes pass as they are (encoded chunk
    frames; a replicated shard's records, encoded once for every standby)."""
    return _serialize


def _serialize(msg: Any) -> bytes:
    if isinstance(msg, bytes):
        return msg
    out: bytes = msg.SerializeToString()
    return out


def deserializer(message: Any) -> Callable[[bytes], Any]:
    """gRPC's deserializer for ``message``: chunks as ``RawChunk``, else protobuf."""
    field = _chunk_field(message)
    parse: Callable[[bytes], Any] = message.FromString
    if field is None:
        return parse

    def deserialize(raw: bytes) -> Any:
        chunk = decode_chunk(raw, field)
        return chunk if chunk is not None else parse(raw)

    return deserialize


def rpc_messages(method: str) -> tuple[Any, Any, bool, bool]:
    """An RPC of the service: its request and reply message classes, and whether
    each is a stream."""
    m = _SERVICE_DESCRIPTOR.methods_by_name[method]
    return (
        getattr(pb, m.input_type.name),
        getattr(pb, m.output_type.name),
        bool(m.client_streaming),
        bool(m.server_streaming),
    )
