"""Stream chunk messages encoded and decoded by hand, with one copy of the bytes.

A stream message (``PushChunk``, ``PullChunk``, ``CreateGroupChunk``, ``ApplyChunk``)
is a oneof of a header and a ``TensorChunk {uint32 index = 1; uint64 offset = 2;
bytes data = 3}``. Through the protobuf API a chunk's bytes are copied four times on
the way out (slice, field, serialize) and three on the way in (parse, field read,
assemble). Here a chunk is written straight from the array's memory into the wire
bytes, and read as a zero-copy view of the received bytes.

The output is the canonical protobuf encoding, so any peer reads it; ``decode_chunk``
accepts only that exact shape and returns None for anything else, so the caller falls
back to the protobuf parser and its error handling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "RawChunk",
    "decode_chunk",
    "deserializer",
    "encode_chunk",
    "iter_raw_chunks",
    "serializer",
]


@dataclass(frozen=True)
class RawChunk:
    """A ``TensorChunk`` whose ``data`` is a view of the message it came in.

    It stands for the whole stream message too (``msg.chunk``, ``WhichOneof``), so
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

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf spelling
        return len(self.data) + 32


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(field: int, index: int, offset: int, data: memoryview) -> bytes:
    """The wire bytes of a stream message whose ``chunk`` (field ``field``) is set."""
    inner = b""
    if index:
        inner += b"\x08" + _varint(index)
    if offset:
        inner += b"\x10" + _varint(offset)
    inner += b"\x1a" + _varint(len(data))
    head = _varint((field << 3) | 2) + _varint(len(inner) + len(data)) + inner
    return b"".join((head, data))


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


def decode_chunk(raw: bytes, field: int) -> RawChunk | None:
    """The chunk of a stream message in canonical form; None for anything else."""
    buf = memoryview(raw)
    end = len(buf)
    tag, pos = _read_varint(buf, 0, end)
    if tag != (field << 3) | 2:
        return None
    length, pos = _read_varint(buf, pos, end)
    if length < 0 or pos + length != end:
        return None
    index = offset = 0
    data: memoryview | None = None
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        if key == 0x08 and data is None:
            index, pos = _read_varint(buf, pos, end)
        elif key == 0x10 and data is None:
            offset, pos = _read_varint(buf, pos, end)
        elif key == 0x1A and data is None:
            size, pos = _read_varint(buf, pos, end)
            if size < 0 or pos + size != end:
                return None
            data = buf[pos:end]
            pos = end
        else:
            return None
        if index < 0 or offset < 0 or index > 0xFFFFFFFF or offset >= 1 << 64:
            return None
    if data is None:
        return None
    return RawChunk(index, offset, data)


def iter_raw_chunks(arrays: Iterable[Any], chunk_bytes: int) -> Iterator[RawChunk]:
    """The bytes of ``arrays`` in order as chunks viewing the arrays' memory.

    The arrays must not change until the stream has sent them.
    """
    for index, a in enumerate(arrays):
        arr = np.asarray(a)
        arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")
        view = memoryview(arr.reshape(-1)).cast("B")  # type: ignore[arg-type]
        for start in range(0, len(view), chunk_bytes):
            yield RawChunk(index, start, view[start : start + chunk_bytes])


def serializer(field: int) -> Callable[[Any], bytes]:
    """A stream message serializer that writes ``RawChunk`` items by hand."""

    def serialize(msg: Any) -> bytes:
        if isinstance(msg, RawChunk):
            return encode_chunk(field, msg.index, msg.offset, msg.data)
        return bytes(msg.SerializeToString())

    return serialize


def deserializer(message: type[Any], field: int) -> Callable[[bytes], Any]:
    """A stream message parser: chunks as zero-copy ``RawChunk``, the rest protobuf."""

    def parse(raw: bytes) -> Any:
        chunk = decode_chunk(raw, field)
        return chunk if chunk is not None else message.FromString(raw)

    return parse
