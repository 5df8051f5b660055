"""The client's side of frame calls (``frames="auto"``, the default, and
``"on"``; ``Client`` and ``AsyncClient``): ``FrameTransport``, a
``TensorTransport`` (see ``_transport``).

Small unary ``Push`` and ``Pull`` calls as frames on a call channel: a data
channel opened with ``CALL_MAGIC`` after an authenticated ``DataChannelHello``
(whose token the server keeps for the channel's calls). The server runs each call
through the same interceptors and servicer as gRPC
(``onnxps.server.transports._frames``). A
status comes back as grpc's would (code, details, rich details), so the client's
errors are the same; a socket that fails mid-call sends the call over gRPC again
(the same seq: applied once). The frames' layout: ``onnxps.wire.frames``. The
socket's steps are ``Blocking`` effects: ``Client`` runs them in the calling
thread, ``AsyncClient`` in a worker thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire import frames
from onnxps.wire.codec import EncodedMessage, rpc_messages
from onnxps.wire.frames import CALL_MAGIC, FRAME_MAX_REQUEST_BYTES, close_socket
from onnxps.wire.replies import first_tensor_offset, reply_parser

from ._datachannel import ChannelBroken, ChannelRefused, connect
from ._errors import RpcError
from ._grpc_transport import InlineTransport
from ._ops import Blocking, Call, Deadline, Op, unary_request, what
from ._replies import tcp_host

__all__ = [
    "CALL_MAGIC",
    "FRAME_MAX_REQUEST_BYTES",
    "FRAME_METHODS",
    "CallChannel",
    "CallChannelLink",
    "FrameBroken",
    "FrameRpcError",
    "FrameTransport",
]

log = logging.getLogger("onnxps.client")

FRAME_METHODS = frames.METHOD_NUMBERS
# each method's reply: its message class and repeated Tensor field, read from a
# frame's bytes with the tensors' bytes left where they were received
# (``onnxps.wire.replies``), the frame received so that the first one is aligned
_TENSOR_FIELDS = {"Push": "values", "Pull": "tensors"}
_REPLIES = {
    m: reply_parser(rpc_messages(m)[1], _TENSOR_FIELDS[m]) for m in FRAME_METHODS
}
_LOCATE: dict[str, Callable[[bytes], int | None]] = {
    m: functools.partial(first_tensor_offset, rpc_messages(m)[1], _TENSOR_FIELDS[m])
    for m in FRAME_METHODS
}
# A refused call channel is asked for again after this, doubled at each refusal
# in a row up to _FRAMES_RETRY_MAX_SECONDS (a port a firewall drops costs a call
# its connect timeout once in a while, not every 10 s)
_FRAMES_RETRY_SECONDS = 10.0
_FRAMES_RETRY_MAX_SECONDS = 600.0
_CONNECT_SECONDS = 3.0  # a hello and a connect never cost a call more than this
# A client of a replicated cluster waits this long for a frame call's reply, then
# closes the channel (the server cancels the call) and resends it over gRPC with
# the same seq: gRPC's pings find a frozen primary within about 2 s
# (``_settings.FOLLOW_KEEPALIVE``), a frame call has no pings of its own
_FOLLOW_REPLY_SECONDS = 2.0
# Statuses a frame call hands to gRPC, whose retry policy resends them (a draining
# or stopping server): the same seq, applied once
_GRPC_RETRIES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_NOT_FRAMED = object()  # a frame call that did not happen: the call goes over gRPC
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
    """One call channel to ``address``: one call at a time (``lock``)."""

    def __init__(self, sock: socket.socket, address: str = "") -> None:
        self.sock = sock
        self.address = address
        self.lock = threading.Lock()
        self.buffers = frames.ReplyBuffers()  # large replies' (calls hold ``lock``)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        close_socket(self.sock)

    def call(
        self,
        method: str,
        request: list[Any],
        timeout: float | None,
        reply_within: float | None = None,
    ) -> memoryview:
        """The reply's bytes; raises FrameRpcError (a status) or FrameBroken (also
        when no reply came within ``reply_within`` seconds)."""
        number = FRAME_METHODS[method]
        deadline = timeout or 0.0
        if reply_within is not None:
            timeout = reply_within if timeout is None else min(timeout, reply_within)
        try:
            self.sock.settimeout(timeout)
            frames.write_call(self.sock, number, deadline, request)
            code, body, details, trailing = frames.read_reply(
                self.sock, _LOCATE[method], self.buffers
            )
        except (OSError, ValueError) as exc:  # a timeout too: the stream is lost
            self.close()
            raise FrameBroken(f"the call channel failed mid-call ({exc})") from None
        if code == 0:
            return body
        raise FrameRpcError(_CODES[code], details, trailing)


def request_bytes(request: Any) -> list[Any] | None:
    """A Push or Pull request's bytes (as pieces: an ``EncodedMessage``'s tensor
    bytes from where they are), or None when it must go over gRPC (tensors in
    shared memory or on a data channel: bound to the gRPC caller)."""
    message = getattr(request, "message", request)
    for field in ("gradients_region", "reply_region", "transfer"):
        with contextlib.suppress(ValueError):  # a message without that field
            if message.HasField(field):
                return None
    if isinstance(request, EncodedMessage):
        return request.parts()
    return [request.SerializeToString()]


class CallChannelLink:
    """The call channels of one client, one per shard (0: the one server), opened
    on first use; a shard that refused one is asked again after
    ``_FRAMES_RETRY_SECONDS`` (its calls meanwhile over gRPC)."""

    def __init__(
        self,
        addresses: list[str],
        tls: Callable[[], ssl.SSLContext | None],
        server_name_override: str | None,
        follows: bool = False,
    ) -> None:
        self.addresses = addresses  # the client's own list: followed as it changes
        self._reply_within = _FOLLOW_REPLY_SECONDS if follows else None
        self._tls = tls
        self._server_name_override = server_name_override
        self.channels: dict[int, CallChannel] = {}
        self._opening: dict[int, threading.Lock] = {}
        self._refused: dict[int, tuple[float, float]] = {}  # until, then the wait

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def refused(self, shard: int) -> bool:
        """Whether ``shard`` refused a call channel lately (its calls: gRPC)."""
        until = self._refused.get(shard)
        return until is not None and time.monotonic() < until[0]

    def call(self, call: Call, shard: int) -> Op[Any]:
        """``call`` (a Push or Pull) as a frame to ``shard``: its reply, or
        ``_NOT_FRAMED`` (send it over gRPC: no channel, the channel busy or
        broken, the request too large or bound to gRPC; a push resent keeps its
        seq, applied once)."""
        ch = self.channels.get(shard)
        if ch is not None and ch.address != self.addresses[shard]:
            ch.close()  # the shard's primary moved (a replicated cluster)
        if ch is None or ch.closed:
            # one caller opens a shard's channel; a call meanwhile goes over gRPC
            opening = self._opening.setdefault(shard, threading.Lock())
            if not opening.acquire(blocking=False):
                return _NOT_FRAMED
            try:
                ch = yield from self._open(shard, call.deadline)
            finally:
                opening.release()
        if ch is None or not ch.lock.acquire(blocking=False):
            return _NOT_FRAMED
        try:
            raw = request_bytes(call.request())
            if raw is None or sum(map(len, raw)) > FRAME_MAX_REQUEST_BYTES:
                return _NOT_FRAMED
            sending = functools.partial(
                ch.call,
                call.method,
                raw,
                call.deadline.remaining(),
                self._reply_within,
            )
            body = yield Blocking(sending, ch.close)
        except FrameBroken as exc:
            log.info("call channel to shard %d: %s; over gRPC", shard, exc)
            return _NOT_FRAMED
        except FrameRpcError as exc:
            if exc.code() in _GRPC_RETRIES:  # gRPC's retry policy resends these
                return _NOT_FRAMED
            error = call.error(exc)
            if getattr(error, "reason", None) == "NOT_PRIMARY":
                # no longer the primary: gRPC's call follows to the new one (the
                # same seq: applied once), and the next call opens a channel there
                ch.close()
                return _NOT_FRAMED
            raise error from None
        finally:
            ch.lock.release()
        return _REPLIES[call.method](body)

    def _open(self, shard: int, deadline: Deadline) -> Op[CallChannel | None]:
        """A new call channel to ``shard`` (hello, connect), else None (refused:
        asked again after ``_FRAMES_RETRY_SECONDS``, doubling while refused)."""
        until, wait = self._refused.get(shard, (0.0, 0.0))
        if time.monotonic() < until:
            return None
        address = self.addresses[shard]
        host = tcp_host(address)
        try:
            if host is None:
                raise OSError("the address is not host:port")
            hello = yield Call(
                "DataChannelHello",
                unary_request(pb.DataChannelHelloRequest()),
                # a server that is away leaves the call most of its time
                Deadline(min(deadline.remaining() / 4, _CONNECT_SECONDS)),
                what("DataChannelHello"),
                shard=shard,
            )
            opening = functools.partial(
                connect,
                host,
                hello.port,
                hello.ticket,
                min(deadline.remaining(), _CONNECT_SECONDS),
                self._tls(),
                self._server_name_override,
                magic=CALL_MAGIC,
            )
            opened = yield Blocking(opening)
        # (LookupError: a Python that cannot load its idna codec cannot resolve)
        except (RpcError, OSError, LookupError, ChannelRefused, ChannelBroken) as exc:
            wait = min(max(2 * wait, _FRAMES_RETRY_SECONDS), _FRAMES_RETRY_MAX_SECONDS)
            self._refused[shard] = (time.monotonic() + wait, wait)
            log.info("no call channel to shard %d (%s); calls over gRPC", shard, exc)
            return None
        self._refused.pop(shard, None)
        ch = self.channels[shard] = CallChannel(opened.sock, address)
        return ch


class FrameTransport(InlineTransport):
    """A unary call's bytes as one frame each way on a call channel to ``shard``
    (each send of a push: a frame first, then gRPC where it did not happen)."""

    def __init__(self, host: Any, link: CallChannelLink, shard: int) -> None:
        super().__init__(host)
        self.link = link
        self.shard = shard

    def send(self, call: Call) -> Op[Any]:
        reply = yield from self.link.call(call, self.shard)
        if reply is _NOT_FRAMED:
            reply = yield call
        return reply
