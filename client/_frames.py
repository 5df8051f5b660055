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
import threading
from typing import Any

import grpc
from onnxps.wire import frames
from onnxps.wire.frames import CALL_MAGIC, FRAME_MAX_REQUEST_BYTES, close_socket

__all__ = [
    "CALL_MAGIC",
    "FRAME_MAX_REQUEST_BYTES",
    "FRAME_METHODS",
    "CallChannel",
    "FrameBroken",
    "FrameRpcError",
]

FRAME_METHODS = frames.METHOD_NUMBERS
_CODES = {number: grpc.StatusCode[name] for number, name in frames.STATUS_NAMES.items()}


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
        close_socket(self.sock)

    def call(self, method: str, request: bytes, timeout: float | None) -> bytes:
        """The reply's bytes; raises FrameRpcError (a status) or FrameBroken."""
        frame = frames.call_frame(FRAME_METHODS[method], timeout or 0.0, request)
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(frame)
            code, body, details, trailing = frames.read_reply(self.sock)
        except (OSError, ValueError) as exc:  # a timeout too: the stream is lost
            self.close()
            raise FrameBroken(f"the call channel failed mid-call ({exc})") from None
        if code == 0:
            return body
        raise FrameRpcError(_CODES[code], details, trailing)


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
