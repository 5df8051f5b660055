"""The frames both ends speak on a socket beside gRPC: the data channel's and the
call channel's (``Client(frames="on")``), written once.

A channel opens with an 8-byte magic and the 32-byte ticket of a
``DataChannelHello``: ``DATA_MAGIC`` for a data channel (tensor bytes of calls made
over gRPC), ``CALL_MAGIC`` for a call channel (whole ``Push`` and ``Pull`` calls).
The server answers ``0x00`` and the 16-byte channel id, or ``0x01``, a ``u16``
length and its reason (UTF-8).

Data channel (little endian): one frame per call each way, ``u64`` transfer id,
``u64`` byte count, then the tensors back to back (``DATA_FRAME``).

Call channel (little endian):

- call: ``u32 length`` of what follows, ``u8 method`` (1 Push, 2 Pull), ``f64
  timeout`` seconds (0: none), the request message.
- reply: ``u32 length`` of what follows, ``u8 code`` (a gRPC status code's number,
  0 OK), then for OK the response message, else ``u32`` length and the details
  (UTF-8), ``u16`` count of trailing metadata entries, each ``u16`` key length, key,
  ``u32`` value length, value (``grpc-status-details-bin`` among them).

The status codes are gRPC's numbers (``STATUS_NAMES``); each end maps them onto
grpc's ``StatusCode`` (this layer imports no grpc). ``recv_exact`` and
``close_socket`` are the socket steps both ends take.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CALL_MAGIC",
    "CHANNEL_ID_BYTES",
    "DATA_FRAME",
    "DATA_MAGIC",
    "FRAME_MAX_REQUEST_BYTES",
    "HEAD",
    "JOIN_BYTES",
    "MAX_CALL_FRAME",
    "ReplyBuffers",
    "METHOD_NAMES",
    "METHOD_NUMBERS",
    "STATUS_NAMES",
    "TICKET_BYTES",
    "U32",
    "call_frame",
    "close_socket",
    "read_reply",
    "recv_exact",
    "send_parts",
    "send_reply",
    "split_call",
    "status_payload",
    "write_call",
]

DATA_MAGIC = b"ONNXPSD1"
CALL_MAGIC = b"ONNXPSC1"
TICKET_BYTES = 32
CHANNEL_ID_BYTES = 16
DATA_FRAME = struct.Struct("<QQ")  # transfer id, byte count

METHOD_NAMES = {1: "Push", 2: "Pull"}
METHOD_NUMBERS = {name: number for number, name in METHOD_NAMES.items()}
# Clients frame requests up to 1 MiB (larger ones go over gRPC: its streams and
# the data channel move bytes best); a server reads frames up to twice that.
FRAME_MAX_REQUEST_BYTES = 1 << 20
MAX_CALL_FRAME = 2 << 20
JOIN_BYTES = 64 << 10  # a reply up to this size is sent in one piece
ALIGN = 64  # ``read_reply`` with ``locate``: where the first tensor lands

# gRPC's status codes by number (grpc.StatusCode[name] on either end)
STATUS_NAMES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}

_U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
HEAD = struct.Struct("<Bd")  # a call's method and timeout

Trailing = list[tuple[str, bytes]]


def recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """``n`` bytes from ``sock``, received straight into the buffer returned (no
    copy after: a call's or reply's bytes are parsed from it), or None when the
    peer closed first (a timeout or a broken socket raises ``OSError``)."""
    buf = bytearray(n)
    return buf if _fill(sock, memoryview(buf), 0) else None


def _fill(sock: socket.socket, view: memoryview, got: int) -> bool:
    """Receive into ``view`` from byte ``got`` to its end; False when the peer
    closed first."""
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            return False
        got += k
    return True


def close_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways and close it (whatever state it is in)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


# -- call channel: calls -----------------------------------------------------------
def call_frame(method: int, timeout: float, request: bytes) -> bytes:
    """One call frame: length, method, timeout (0: none), the request."""
    body = HEAD.pack(method, timeout) + request
    return U32.pack(len(body)) + body


def write_call(
    sock: socket.socket,
    method: int,
    timeout: float,
    request: bytes | bytearray | memoryview | Sequence[Any],
) -> None:
    """Send one call frame (the client's side): the request (bytes, or its pieces,
    each bytes-like) after the frame's head; a small request joined into one send,
    a large one's pieces sent from where they are (``send_parts``), not copied into
    one frame."""
    pieces: Sequence[Any] = (
        [request] if isinstance(request, bytes | bytearray | memoryview) else request
    )
    size = sum(memoryview(p).nbytes for p in pieces)
    head = U32.pack(HEAD.size + size) + HEAD.pack(method, timeout)
    if size <= JOIN_BYTES:
        sock.sendall(b"".join([head, *pieces]))
        return
    send_parts(sock, [head, *pieces])


def send_parts(sock: socket.socket, parts: Sequence[Any]) -> None:
    """Send ``parts`` (bytes-like) in order: gathered by ``sendmsg`` on a plain
    socket (no copy into one buffer), one ``sendall`` each over TLS."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    if not hasattr(sock, "sendmsg") or isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def split_call(body: bytes | bytearray) -> tuple[int, float, bytes | bytearray]:
    """A call frame's body (after its length): method, timeout, request bytes."""
    method, timeout = HEAD.unpack_from(body)
    return method, timeout, body[HEAD.size :]


# -- call channel: replies ---------------------------------------------------------
def status_payload(details: str, trailing: Sequence[tuple[str, Any]]) -> bytes:
    """A failed call's reply after its code byte: details and trailing metadata."""
    text = details.encode("utf-8")
    out = [U32.pack(len(text)), text, _U16.pack(len(trailing))]
    for key, value in trailing:
        k = key.encode("ascii")
        v = value if isinstance(value, bytes) else str(value).encode("utf-8")
        out += [_U16.pack(len(k)), k, U32.pack(len(v)), v]
    return b"".join(out)


def send_reply(sock: socket.socket, code: int, parts: Sequence[Any]) -> None:
    """One reply frame: the length and ``code``, then ``parts`` (small ones joined,
    large ones sent from where they are)."""
    size = sum(memoryview(p).nbytes for p in parts)
    head = U32.pack(1 + size) + bytes([code])
    if size <= JOIN_BYTES:
        sock.sendall(b"".join([head, *parts]))
        return
    sock.sendall(head)
    for part in parts:
        sock.sendall(part)


def read_reply(
    sock: socket.socket,
    locate: Callable[[bytes], int | None] | None = None,
    buffers: ReplyBuffers | None = None,
) -> tuple[int, memoryview, str, Trailing]:
    """One reply frame: (code, response bytes (a view of the frame as received),
    details, trailing metadata).

    ``locate`` (a large reply's first bytes after its code -> where in the
    response the first tensor's bytes start, or None): the frame is received
    into a buffer placed so that those bytes are ``ALIGN``-aligned
    (``replies.TensorReply`` then reads them where they are), taken from
    ``buffers`` when given (a buffer whose last reply nothing reads any more).
    Raises ``ConnectionError`` when the server closed the channel first, and
    ``ValueError`` on a reply that is not a frame."""
    head = recv_exact(sock, 4)
    if head is None:
        raise ConnectionError("the server closed the call channel")
    size = U32.unpack(head)[0]
    payload: bytearray | memoryview | None
    if locate is not None and size > _LOCATE_BYTES:
        payload = _recv_aligned(sock, size, locate, buffers or ReplyBuffers(0))
    else:
        payload = recv_exact(sock, size)
    if not payload:
        raise ConnectionError("the server closed the call channel mid-reply")
    code = payload[0]
    if code not in STATUS_NAMES:
        raise ValueError(f"the call channel sent status {code}")
    if code == 0:
        return code, memoryview(payload)[1:], "", []
    details, trailing = _status(bytes(payload))
    return code, memoryview(b""), details, trailing


_LOCATE_BYTES = 4096  # a reply's first bytes read to place its tensors


class ReplyBuffers:
    """Receive buffers of one channel's large replies, each used again once
    nothing received into it is referenced any more (the arrays a pull returned
    are views of it: a weak reference to what was handed out says when they are
    all gone). A fresh buffer per reply costs its page faults on every call
    (0.2-2 ms for 800 KB, by the state of the process's malloc); a training loop
    that drops the last pull's arrays at the next one reuses two buffers.
    Buffers over ``max_bytes`` are not kept."""

    def __init__(self, keep: int = 2, max_bytes: int = 8 << 20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._kept: list[tuple[np.ndarray[Any, Any], Callable[[], Any] | None]] = []

    def take(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A uint8 buffer of at least ``nbytes`` (at most twice that) that nothing
        reads, kept or new."""
        for i, (store, handed) in enumerate(self._kept):
            if (handed is None or handed() is None) and (
                nbytes <= store.size <= 2 * nbytes
            ):
                self._kept[i] = (store, None)
                return store
        store = np.empty(nbytes, np.uint8)
        if self.keep and nbytes <= self.max_bytes:
            free = [
                i for i, (_, h) in enumerate(self._kept) if h is None or h() is None
            ]
            if len(self._kept) >= self.keep:  # replace a free one, else the oldest
                del self._kept[free[0] if free else 0]
            self._kept.append((store, None))
        return store

    def handed_out(
        self, store: np.ndarray[Any, Any], part: np.ndarray[Any, Any]
    ) -> None:
        """``part`` (a view of ``store``) is what the reply's readers hold."""
        for i, (kept, _) in enumerate(self._kept):
            if kept is store:
                self._kept[i] = (store, weakref.ref(part))


def _recv_aligned(
    sock: socket.socket,
    size: int,
    locate: Callable[[bytes], int | None],
    buffers: ReplyBuffers,
) -> memoryview | None:
    """A reply frame's ``size`` bytes, in a buffer placed by ``locate`` (see
    ``read_reply``); None when the peer closed first."""
    first = recv_exact(sock, _LOCATE_BYTES)
    if first is None:
        return None
    at = locate(bytes(first[1:])) if first[0] == 0 else None
    store = buffers.take(size + ALIGN)
    # the frame starts `shift` bytes in, so that its byte 1 + at is aligned
    shift = (-(store.ctypes.data + 1 + (at or 0))) % ALIGN
    part = store[shift : shift + size]
    buffers.handed_out(store, part)
    payload = memoryview(part)  # type: ignore[arg-type]
    payload[:_LOCATE_BYTES] = first
    return payload if _fill(sock, payload, _LOCATE_BYTES) else None


def _status(payload: bytes) -> tuple[str, Trailing]:
    """The details and trailing metadata of a reply frame with a status."""
    (n,) = U32.unpack_from(payload, 1)
    details = payload[5 : 5 + n].decode("utf-8")
    at = 5 + n
    (count,) = _U16.unpack_from(payload, at)
    at += 2
    trailing: Trailing = []
    for _ in range(count):
        (klen,) = _U16.unpack_from(payload, at)
        key = payload[at + 2 : at + 2 + klen].decode("ascii")
        at += 2 + klen
        (vlen,) = U32.unpack_from(payload, at)
        trailing.append((key, payload[at + 4 : at + 4 + vlen]))
        at += 4 + vlen
    return details, trailing
