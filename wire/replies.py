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

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .codec import (
    TensorFormatError,
    _read_varint,
    _varint,
    check_carried,
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
            check_carried(t, dtype, dims, size, t.name)
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


def _fields(
    buf: memoryview, start: int, end: int, *, partial: bool = False
) -> Iterator[tuple[int, int, int, int]]:
    """Each field of the message at ``buf[start:end]``: (key, where the field
    starts, where its value starts, where it ends; a length-delimited value is
    its bytes). ``partial``: the bytes are a message's beginning, so a
    length-delimited field may run past ``end`` (it ends the walk, cut at
    ``end``). Anything else that does not fit raises ``TensorFormatError``."""
    pos = start
    while pos < end:
        key, after = _read_varint(buf, pos, end)
        if key < 0:
            raise _bad("a truncated key")
        wire_type = key & 7
        value_at = after
        if wire_type == 2:
            size, body = _read_varint(buf, after, end)
            if size < 0:
                raise _bad("a truncated length")
            if body + size > end:
                if not partial:
                    raise _bad("a field running past its message")
                yield key, pos, body, end
                return
            value_at, stop = body, body + size
        elif wire_type == 0:
            value, stop = _read_varint(buf, after, end)
            if value < 0:
                raise _bad("a truncated varint")
        elif wire_type in (1, 5):
            stop = after + (8 if wire_type == 1 else 4)
            if stop > end:
                raise _bad("a field running past its message")
        else:
            raise _bad(f"wire type {wire_type}")
        yield key, pos, value_at, stop
        pos = stop


def _bad(what: str) -> TensorFormatError:
    return TensorFormatError(f"the reply is not a protobuf message ({what})")


def _tensor_without_bytes(
    buf: memoryview, start: int, end: int
) -> tuple[bytes, Span | None]:
    """A Tensor's fields at ``buf[start:end]`` without its raw_data (the last one
    counts, as protobuf reads a repeated singular field), and where that was."""
    kept: list[Any] = []
    span: Span | None = None
    at = start
    for key, field_at, value_at, stop in _fields(buf, start, end):
        if key == _RAW_DATA:
            kept.append(buf[at:field_at])
            span = (value_at, stop - value_at)
            at = stop
    kept.append(buf[at:end])
    return b"".join(kept), span


def parse_tensor_reply(
    message: Any, field: str, data: bytes | bytearray | memoryview
) -> TensorReply:
    """Reply ``data`` (wire bytes of protobuf class ``message``) parsed with its
    repeated Tensor field ``field`` left in place (``TensorReply``)."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    wanted = _tensor_key(message, field)
    parts: list[Any] = []
    spans: list[Span | None] = []
    at = 0
    for key, field_at, value_at, stop in _fields(buf, 0, len(buf)):
        if key == wanted:
            inner, span = _tensor_without_bytes(buf, value_at, stop)
            parts += [buf[at:field_at], _varint(wanted), _varint(len(inner)), inner]
            spans.append(span)
            at = stop
    parts.append(buf[at:])
    return TensorReply(message.FromString(b"".join(parts)), field, buf, spans)


def _tensor_key(message: Any, field: str) -> int:
    """The key (tag) of repeated Tensor field ``field`` of class ``message``."""
    number: int = message.DESCRIPTOR.fields_by_name[field].number
    return (number << 3) | 2


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
    wanted = _tensor_key(message, field)
    try:
        for key, _, value_at, stop in _fields(buf, 0, len(buf), partial=True):
            if key == wanted:
                for inner, _, data_at, _ in _fields(buf, value_at, stop, partial=True):
                    if inner == _RAW_DATA:
                        return data_at
                return None
    except TensorFormatError:  # the prefix ends mid-field
        return None
    return None
