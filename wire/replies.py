"""A reply's tensors read where they were received: ``Pull`` and ``Push`` replies
taken apart without protobuf copying their tensor bytes.

Parsing a reply with protobuf copies its tensor bytes into the message, reading a
``raw_data`` copies them again (a new ``bytes``), and an array the caller may write
needs a third copy. ``parse_tensor_reply`` walks the reply's wire bytes instead:
each tensor of the repeated ``Tensor`` field (``PullResponse.tensors``,
``PushResponse.values``) is parsed by protobuf without its ``raw_data``, whose place
in the received buffer is kept, and ``TensorReply.arrays`` gives the tensors as
arrays over that buffer: no copy when the buffer is writable and a tensor's bytes
sit aligned for its dtype (``frames.read_reply`` receives a reply so that the first
one does), one copy otherwise. Every check ``codec.tensors_to_arrays`` makes is made
(dtype, dims, encoding, byte count) with the same messages.

Bytes that are not the protobuf wire format raise ``TensorFormatError``, as a bad
reply parsed by protobuf would fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .codec import (
    ENCODING_NAMES,
    TensorFormatError,
    _read_varint,
    _varint,
    _wire_itemsize,
    tensor_spec,
    tensor_to_array,
    tensors_to_arrays,
)
from .encoding import widen_into

__all__ = [
    "IN_PLACE_BYTES",
    "TensorReply",
    "first_tensor_offset",
    "parse_tensor_reply",
    "reply_parser",
    "tensor_arrays",
    "tensor_views",
]

Array = np.ndarray[Any, Any]
Span = tuple[int, int]  # (offset, byte count) of a tensor's raw_data in the buffer
_RAW_DATA = (4 << 3) | 2  # Tensor.raw_data: field 4, length-delimited


class TensorReply:
    """A reply message whose ``field`` tensors carry no bytes (``message``), and
    where each one's bytes are in ``buffer``. Other fields read as the message's."""

    __slots__ = ("buffer", "field", "message", "spans")

    def __init__(
        self, message: Any, field: str, buffer: memoryview, spans: list[Span | None]
    ) -> None:
        self.message = message
        self.field = field
        self.buffer = buffer
        self.spans = spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def views(self, *, encoded: bool = False) -> list[Array]:
        """The tensors as arrays over the buffer where they can be (read-only when
        the buffer is, perhaps unaligned), an encoded one widened into a new one."""
        out = []
        for t, span in zip(getattr(self.message, self.field), self.spans, strict=True):
            dtype, dims = tensor_spec(t, t.name, encoded=encoded)
            offset, size = span or (0, 0)
            expected = math.prod(dims) * _wire_itemsize(t, dtype)
            if size != expected:
                encoding = (
                    f" encoded as {ENCODING_NAMES[t.encoding]}" if t.encoding else ""
                )
                raise TensorFormatError(
                    f"{t.name} declares {dtype.name} dims {list(dims)}{encoding}, "
                    f"which is {expected} bytes, but carries {size} bytes"
                )
            raw = self.buffer[offset : offset + size]
            if t.encoding:
                a = np.empty(dims, dtype)
                widen_into(a.reshape(-1), raw, t.encoding)
            else:
                a = np.frombuffer(raw, dtype=dtype).reshape(dims)
            out.append(a)
        return out

    def arrays(self, *, encoded: bool = False) -> list[Array]:
        """The tensors as writable, aligned arrays: the buffer's own bytes where
        they are both already, else copied once (all copies into one new buffer,
        as ``tensors_to_arrays`` makes them)."""
        views = self.views(encoded=encoded)
        if all(v.flags.writeable and v.flags.aligned for v in views):
            return views
        if len(views) > 1 and len({v.dtype for v in views}) == 1:
            flat = np.empty(sum(v.size for v in views), views[0].dtype)
            out, pos = [], 0
            for v in views:
                part = flat[pos : pos + v.size].reshape(v.shape)
                part[...] = v
                out.append(part)
                pos += v.size
            return out
        return [v if v.flags.writeable and v.flags.aligned else v.copy() for v in views]


def tensor_arrays(msg: Any, field: str, *, encoded: bool = False) -> list[Array]:
    """A reply's ``field`` tensors as writable arrays of their own: from the
    received buffer for a ``TensorReply``, else copied out of the message."""
    if isinstance(msg, TensorReply):
        return msg.arrays(encoded=encoded)
    return tensors_to_arrays(getattr(msg, field), encoded=encoded)


def tensor_views(msg: Any, field: str) -> list[Array]:
    """A reply's ``field`` tensors as arrays to read (and copy from) only."""
    if isinstance(msg, TensorReply):
        return msg.views()
    return [tensor_to_array(t, t.name) for t in getattr(msg, field)]


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    """The position after a field's value of ``wire_type`` at ``pos``."""
    if wire_type == 0:
        value, pos = _read_varint(buf, pos, end)
        if value < 0:
            raise _bad("a truncated varint")
    elif wire_type == 1:
        pos += 8
    elif wire_type == 2:
        size, pos = _read_varint(buf, pos, end)
        if size < 0:
            raise _bad("a truncated length")
        pos += size
    elif wire_type == 5:
        pos += 4
    else:
        raise _bad(f"wire type {wire_type}")
    if pos > end:
        raise _bad("a field running past its message")
    return pos


def _bad(what: str) -> TensorFormatError:
    return TensorFormatError(f"the reply is not a protobuf message ({what})")


def _tensor_without_bytes(
    buf: memoryview, start: int, end: int
) -> tuple[bytes, Span | None]:
    """A Tensor's fields at ``buf[start:end]`` without its raw_data (the last one
    counts, as protobuf reads a repeated singular field), and where that was."""
    kept: list[Any] = []
    span: Span | None = None
    pos = at = start
    while pos < end:
        key, after = _read_varint(buf, pos, end)
        if key < 0:
            raise _bad("a truncated key")
        if key == _RAW_DATA:
            size, body = _read_varint(buf, after, end)
            if size < 0 or body + size > end:
                raise _bad("raw_data running past its tensor")
            kept.append(buf[at:pos])
            span = (body, size)
            pos = at = body + size
        else:
            pos = _skip(buf, after, end, key & 7)
    kept.append(buf[at:end])
    return b"".join(kept), span


def parse_tensor_reply(
    message: Any, field: str, data: bytes | bytearray | memoryview
) -> TensorReply:
    """Reply ``data`` (wire bytes of protobuf class ``message``) parsed with its
    repeated Tensor field ``field`` left in place (``TensorReply``)."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    number = message.DESCRIPTOR.fields_by_name[field].number
    wanted = (number << 3) | 2
    parts: list[Any] = []
    spans: list[Span | None] = []
    end = len(buf)
    pos = at = 0
    while pos < end:
        key, after = _read_varint(buf, pos, end)
        if key < 0:
            raise _bad("a truncated key")
        if key != wanted:
            pos = _skip(buf, after, end, key & 7)
            continue
        size, body = _read_varint(buf, after, end)
        if size < 0 or body + size > end:
            raise _bad("a tensor running past the reply")
        inner, span = _tensor_without_bytes(buf, body, body + size)
        parts += [buf[at:pos], _varint(wanted), _varint(len(inner)), inner]
        spans.append(span)
        pos = at = body + size
    parts.append(buf[at:end])
    return TensorReply(message.FromString(b"".join(parts)), field, buf, spans)


IN_PLACE_BYTES = 64 << 10  # smaller replies: protobuf's parse (its copies cost less)


def reply_parser(message: Any, field: str) -> Callable[[Any], Any]:
    """Reply class ``message``'s parser: a reply over ``IN_PLACE_BYTES`` read with
    its ``field`` tensors in place (``parse_tensor_reply``), a smaller one by
    protobuf (walking it in Python would cost more than its copies)."""

    def parse(data: Any) -> Any:
        if len(data) <= IN_PLACE_BYTES:
            return message.FromString(data)
        return parse_tensor_reply(message, field, data)

    return parse


def first_tensor_offset(message: Any, field: str, prefix: Sequence[int]) -> int | None:
    """Where the bytes of the first ``field`` tensor start in a reply beginning
    with ``prefix``, or None when ``prefix`` does not reach them."""
    buf = memoryview(bytes(prefix))
    number = message.DESCRIPTOR.fields_by_name[field].number
    wanted = (number << 3) | 2
    end = len(buf)
    pos = 0
    try:
        while pos < end:
            key, pos = _read_varint(buf, pos, end)
            if key < 0:
                return None
            if key != wanted:
                pos = _skip(buf, pos, end, key & 7)
                continue
            size, pos = _read_varint(buf, pos, end)
            if size < 0:
                return None
            stop = pos + size
            while pos < min(stop, end):
                key, pos = _read_varint(buf, pos, end)
                if key == _RAW_DATA:
                    size, pos = _read_varint(buf, pos, end)
                    return pos if size >= 0 and pos <= end else None
                if key < 0:
                    return None
                pos = _skip(buf, pos, end, key & 7)
            return None
    except TensorFormatError:  # the prefix ends mid-field
        return None
    return None
