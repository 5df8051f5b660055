"""The client's side of frame calls (``Client(frames="on")``).

Small unary ``Push`` and ``Pull`` calls as frames on a call channel: a data
channel opened with ``CALL_MAGIC`` after an authenticated ``DataChannelHello``
(whose token the server keeps for the channel's calls). The server runs each call
through the same interceptors and servicer as gRPC (``onnxps.server._frames``). A
status comes back as grpc's would (code, details, rich details), so the client's
errors are the same; a socket that fails mid-call sends the call over gRPC again
(the same seq: applied once).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any

import grpc

__all__ = [
    "CALL_MAGIC",
    "FRAME_MAX_REQUEST_BYTES",
    "FRAME_METHODS",
    "CallChannel",
    "FrameBroken",
    "FrameRpcError",
]

CALL_MAGIC = b"ONNXPSC1"
FRAME_METHODS = {"Push": 1, "Pull": 2}
# Larger requests go over gRPC (its streams and the data channel move bytes best)
FRAME_MAX_REQUEST_BYTES = 1 << 20
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<Bd")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FrameBroken(Exception):
    """The call channel failed without the server's word: resend over gRPC."""


class FrameRpcError(grpc.RpcError):
    """A frame call's status, read as a grpc error (code, details, trailers)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: list[tuple[str, bytes]]
    ) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:  # type: ignore[override]
        return self._trailing


class CallChannel:
    """One call channel: one call at a time (``lock``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def call(self, method: str, request: bytes, timeout: float | None) -> bytes:
        """The reply's bytes; raises FrameRpcError (a status) or FrameBroken."""
        body = _HEAD.pack(FRAME_METHODS[method], timeout or 0.0) + request
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(_U32.pack(len(body)) + body)
            payload = self._recv(_U32.unpack(self._recv(4))[0])
        except OSError as exc:  # a timeout too: where the stream stands is unknown
            self.close()
            raise FrameBroken(f"the call channel failed mid-call ({exc})") from None
        if not payload:
            self.close()
            raise FrameBroken("the call channel sent an empty reply")
        code = _CODES.get(payload[0])
        if code is grpc.StatusCode.OK:
            return payload[1:]
        if code is None:
            self.close()
            raise FrameBroken(f"the call channel sent status {payload[0]}")
        raise FrameRpcError(code, *_status(payload))

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise OSError("the server closed the call channel")
            got += k
        return bytes(buf)


def _status(payload: bytes) -> tuple[str, list[tuple[str, bytes]]]:
    (n,) = _U32.unpack_from(payload, 1)
    details = payload[5 : 5 + n].decode("utf-8")
    at = 5 + n
    (count,) = struct.unpack_from("<H", payload, at)
    at += 2
    trailing: list[tuple[str, bytes]] = []
    for _ in range(count):
        (klen,) = struct.unpack_from("<H", payload, at)
        key = payload[at + 2 : at + 2 + klen].decode("ascii")
        at += 2 + klen
        (vlen,) = _U32.unpack_from(payload, at)
        value = payload[at + 4 : at + 4 + vlen]
        trailing.append((key, value if key.endswith("-bin") else value))
        at += 4 + vlen
    return details, trailing


def request_bytes(request: Any) -> bytes | None:
    """A Push or Pull request's bytes, or None when it must go over gRPC (tensors in
    shared memory or on a data channel: bound to the gRPC caller)."""
    message = getattr(request, "message", request)
    for field in ("gradients_region", "reply_region", "transfer"):
        with contextlib.suppress(ValueError):  # a message without that field
            if message.HasField(field):
                return None
    data: bytes = request.SerializeToString()
    return data
