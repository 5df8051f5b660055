"""Small unary calls as frames on a data channel's socket (``Client``'s default).

``benchmarks/socket_path.py`` measured onnxps's own Push path served per frame on a
plain socket at 0.72x the raw gRPC floor's server CPU and a p50 of 222 µs, against
1.79x and 1,022 µs over gRPC: grpc's per-call hand-offs between threads are most of
a small call's cost. This serves ``Push`` and ``Pull`` that way on a data channel
opened with ``CALL_MAGIC``: one thread per such channel reads a call, runs it
through the same interceptor chain and servicer as gRPC (tokens, shard routing,
limits, drain, metrics, exactly once: all unchanged) with a stand-in for grpc's
per-call context, and writes the reply or the status.

At most ``MAX_CALL_CHANNELS`` are open at once (``_datachannel``); a frame begun
must keep coming (``--stall-seconds``); a draining server's hooks refuse new calls
as over gRPC, and its stop closes the channels. A client that closes its channel
mid-call ends the call as a cancelled gRPC call (``FrameCalls.watch``). A reply
is sent from the handler's own buffers (a large pull's tensors are not copied
into a frame), and what the call holds of the in-flight budget is released once
it has left. The client: ``client/_frames.py``; the docs: docs/transports.md,
"Frame calls".

The frames' layout, magic and status numbers: ``onnxps.wire.frames``.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from onnxps.wire import frames
from onnxps.wire.codec import EncodedMessage
from onnxps.wire.frames import CALL_MAGIC, HEAD, recv_exact, write_call

log = logging.getLogger("onnxps.frames")

__all__ = [
    "CALL_MAGIC",
    "METHODS",
    "FrameCalls",
    "read_reply",
    "send_reply",
    "write_call",
]

METHODS = frames.METHOD_NAMES
MAX_FRAME = frames.MAX_CALL_FRAME
_SERVICE = "/onnxps.v1.ParameterServerService/"


class _Aborted(Exception):
    """Raised by the context's abort: the call ended with its status."""


class FrameContext:
    """What the servicer and the interceptors ask of grpc's per-call context."""

    def __init__(self, metadata: Sequence[tuple[str, Any]], peer: str, timeout: float):
        self._metadata = tuple(metadata)
        self._peer = peer
        self._deadline = time.monotonic() + timeout if timeout > 0 else None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []  # None: the call ended
        self._gone = False

    # -- what grpc.ServicerContext offers, as the handlers use it -------------------
    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        if self._gone:
            return False
        return self._deadline is None or time.monotonic() < self._deadline

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """As grpc's: False (and never run) once the call has ended."""
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        raise _Aborted(details)

    def abort_with_status(self, status: Any) -> None:
        self._trailing = self._trailing + tuple(status.trailing_metadata or ())
        self.abort(status.code, status.details)

    def cancel(self) -> None:
        """The client went away (it closed its call channel): as a cancelled gRPC
        call, the call is no longer active and its callbacks run now (a wait for a
        version wakes and ends, what the call held is released)."""
        self._gone = True
        self.done()

    def done(self) -> None:
        """The call ended: what ``add_callback`` registered runs now (once)."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - as grpc: logged, the others run
                log.exception("a call's callback failed")


def _status_payload(ctx: FrameContext) -> bytes:
    """A failed call's reply after its code byte: details and trailing metadata."""
    return frames.status_payload(ctx.details(), ctx.trailing_metadata())


def _response_parts(reply: Any, serialize: Callable[[Any], bytes]) -> list[Any]:
    """An OK reply's bytes: an encoded message's parts as they are (a large pull's
    tensors are not joined, nor copied into a frame)."""
    if isinstance(reply, EncodedMessage):
        return reply.parts()
    return [serialize(reply)]


def send_reply(sock: socket.socket, code: grpc.StatusCode, parts: list[Any]) -> None:
    """One reply frame: the length and code, then ``parts``."""
    frames.send_reply(sock, code.value[0], parts)


def read_reply(
    sock: socket.socket,
) -> tuple[grpc.StatusCode, bytes, str, list[tuple[str, bytes]]]:
    """One reply frame: (code, response bytes, details, trailing metadata)."""
    number, body, details, trailing = frames.read_reply(sock)
    code = grpc.StatusCode[frames.STATUS_NAMES[number]]
    return code, bytes(body), details, trailing


class FrameCalls:
    """Serves call channels: each call through ``chain`` to the method's handler.

    A call whose client closes its channel ends as a cancelled gRPC call does:
    ``watch`` (the data channels' reaper, every ``REAP_SECONDS``) sees the socket
    readable mid-call (at its end, or carrying bytes a client sends only after its
    reply) and cancels the call's context: a wait for a version wakes and ends,
    and the call's thread and socket go.
    """

    def __init__(self, chain: Any, handlers: dict[str, Any]) -> None:
        self._chain = chain  # the server's HookChain
        self.calls = 0  # calls answered (tests, logs)
        self._handlers = {number: handlers[name] for number, name in METHODS.items()}
        self._details = {
            number: _Details(_SERVICE + name) for number, name in METHODS.items()
        }
        self._lock = threading.Lock()
        self._running: dict[socket.socket, FrameContext] = {}  # calls in handlers

    def serve(
        self,
        sock: socket.socket,
        metadata: Sequence[tuple[str, Any]],
        peer: str,
        stall_seconds: float = 30.0,
    ) -> None:
        """Answer calls on ``sock`` until the client closes it (or sends garbage,
        or stops for ``stall_seconds`` in the middle of a frame)."""
        details_of = {n: d.with_metadata(metadata) for n, d in self._details.items()}
        # the chain decides from the method and the metadata, which a channel
        # keeps: each method's plan is asked for once per channel
        plans: dict[int, Any] = {}
        with sock:
            while True:
                sock.settimeout(None)  # idle between calls: as long as it likes
                head = recv_exact(sock, 1)
                if head is None:
                    return
                sock.settimeout(stall_seconds)  # a frame begun must keep coming
                rest = recv_exact(sock, 3)
                if rest is None:
                    return
                head += rest
                (length,) = frames.U32.unpack(head)
                if not HEAD.size <= length <= MAX_FRAME:
                    log.info(
                        "call channel of %s: a frame of %d bytes; closed", peer, length
                    )
                    return
                body = recv_exact(sock, length)
                if body is None:
                    return
                method, timeout = HEAD.unpack_from(body)
                if method not in self._handlers:
                    log.info(
                        "call channel of %s: unknown method %d; closed", peer, method
                    )
                    return
                ctx = FrameContext(metadata, peer, timeout)
                plan = plans.get(method)
                if plan is None:
                    plan = plans[method] = self._chain.plan(
                        self._handlers[method], details_of[method]
                    )
                try:
                    code, parts = self._call(sock, ctx, plan, body)
                    del body
                    send_reply(sock, code, parts)
                finally:
                    # after the reply left: what the call held (a pull's reply
                    # bytes in the in-flight budget) is counted until then
                    ctx.done()

    def _call(
        self,
        sock: socket.socket,
        ctx: FrameContext,
        plan: Any,
        body: bytearray,
    ) -> tuple[grpc.StatusCode, list[Any]]:
        """Run one call (its method's ``Plan``: the interceptors' hooks around
        its handler): its status and the reply's parts after the code byte."""
        self.calls += 1
        with self._lock:
            self._running[sock] = ctx
        try:
            request = memoryview(body)[HEAD.size :]  # parsed from where it came
            reply = plan.call_frame(request, ctx, ctx.invocation_metadata())
            ok = grpc.StatusCode.OK
            return ok, _response_parts(reply, plan.serialize)
        except _Aborted:
            code = ctx.code() or grpc.StatusCode.UNKNOWN
        except Exception as exc:  # noqa: BLE001 - as grpc: UNKNOWN, logged
            log.exception("a frame call failed")
            ctx.set_details(f"{type(exc).__name__}: {exc}")
            code = grpc.StatusCode.UNKNOWN
        finally:
            with self._lock:
                self._running.pop(sock, None)
        return code, [_status_payload(ctx)]

    def watch(self) -> int:
        """Cancel the calls whose client closed its call channel; how many."""
        with self._lock:
            running = dict(self._running)
        if not running:
            return 0
        # poll/epoll: select() cannot watch a descriptor above 1023
        with selectors.DefaultSelector() as sel:
            for sock in running:
                with contextlib.suppress(ValueError, OSError, KeyError):
                    sel.register(sock, selectors.EVENT_READ, sock)
            ready: list[socket.socket] = [key.data for key, _ in sel.select(0)]
        gone = 0
        for sock in ready:
            with self._lock:
                ctx = self._running.pop(sock, None)
            if ctx is not None:
                log.info(
                    "call channel of %s: its client closed it mid-call; the call "
                    "ends (CANCELLED)",
                    ctx.peer(),
                )
                ctx.cancel()
                gone += 1
        return gone


class _Details:
    """``grpc.HandlerCallDetails`` for a frame call."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, metadata: Sequence[tuple[str, Any]] = ()) -> None:
        self.method = method
        self.invocation_metadata = tuple(metadata)

    def with_metadata(self, metadata: Sequence[tuple[str, Any]]) -> _Details:
        return _Details(self.method, metadata)
