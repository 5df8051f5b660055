"""Admission: the graceful stop's gate, bounded in-flight bytes and streams, and
undecodable requests.

``grpc.Server.stop`` cancels the calls gRPC has received but not yet handed to a
handler thread (the client sees a bare ``CANCELLED``: not retried, and it cannot tell
whether a push was applied). So a graceful stop first closes the ``DrainGate``: every
call that reaches a handler from then on is answered UNAVAILABLE, which clients retry
(a push with the same ``(client_id, seq)``, applied once), and the calls already past
the gate run to the end. Only when they have finished does the server itself stop,
with nothing left in flight to cancel. The gate is the outermost check but one (after
observing, before tokens); the limits are the innermost.

The ``LimitsInterceptor`` refuses work it cannot hold instead of queueing it: a call
whose bytes would take the server over ``max_inflight_bytes``, or a stream beyond
``max_concurrent_streams``, fails at once with RESOURCE_EXHAUSTED. A call on the data
channel counts as a stream: its thread, too, waits for the client's bytes. A request
stream whose client stops sending is ended by the ``StallWatch``. The bytes of a call
are the size of a unary request, or for a request stream the size of its header plus the
tensor bytes the header declares (what the server will preallocate), counted before
anything is allocated. A request whose bytes do not parse gets INVALID_ARGUMENT.

The same ``InflightBytes`` budget counts the replies of pulls (the servicer holds a
pull's bytes from before the copy until its stream ends or is cancelled), so readers
that never read cannot pin memory the budget does not see.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.message import Message
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import EncodedMessage, TensorFormatError, declared_nbytes

from ..errors import InvalidArgument, ResourceExhausted
from ._handlers import SERVICE, Call, CallHooks, Handler, HookInterceptor, Malformed
from ._stall import StallWatch
from ._status import refuse

__all__ = [
    "DrainGate",
    "InflightBytes",
    "InflightHold",
    "LimitsInterceptor",
    "declared_bytes",
    "message_bytes",
]


def _tensor_bytes(t: pb.Tensor) -> int:
    try:
        return declared_nbytes(t)
    except TensorFormatError:
        return 0  # the servicer rejects it with INVALID_ARGUMENT


def declared_bytes(msg: Message) -> int:
    """Tensor bytes a stream's first message declares (its header's Tensor lists)."""
    part = msg.WhichOneof("part") if "part" in msg.DESCRIPTOR.oneofs_by_name else None
    body = getattr(msg, part) if part else msg
    if not isinstance(body, Message):
        return 0
    total = 0
    for field, value in body.ListFields():
        if field.message_type is pb.Tensor.DESCRIPTOR and field.is_repeated:
            total += sum(_tensor_bytes(t) for t in value)
        elif field.message_type in _ROW_MESSAGES and field.is_repeated:
            # a row push's or pull's tensors sit one level down (RowGradient...)
            total += sum(
                _tensor_bytes(t)
                for m in value
                for f, t in m.ListFields()
                if f.message_type is pb.Tensor.DESCRIPTOR
            )
    return total


_ROW_MESSAGES = (pb.RowGradient.DESCRIPTOR, pb.RowSelection.DESCRIPTOR)


def message_bytes(msg: Any) -> int:
    """About the wire size of a message, without encoding a large one.

    ``ByteSize()`` serializes the whole message in upb (~170 ms for 64 MiB), so a
    message that carries tensors is sized from their declared dims instead.
    """
    if isinstance(msg, Malformed):
        return msg.size
    if isinstance(msg, bytes):  # an encoded chunk frame (codec.chunk_frames)
        return len(msg)
    if isinstance(msg, EncodedMessage):  # tensors encoded by hand: its size known
        return msg.ByteSize()
    if not isinstance(msg, Message):
        return 0
    declared = declared_bytes(msg)
    return declared + 256 if declared else msg.ByteSize()


def _malformed_message(m: Malformed) -> str:
    return (
        f"the request of {m.error.partition(':')[0]} is not a valid protobuf message "
        f"({m.size} bytes): {m.error.partition(': ')[2]}"
    )


def _checked(first: Any, it: Iterator[Any]) -> Iterator[Any]:
    yield first
    for msg in it:
        if isinstance(msg, Malformed):
            # Raised inside the servicer, which maps it to INVALID_ARGUMENT.
            raise InvalidArgument(_malformed_message(msg))
        yield msg


class InflightBytes:
    """The request and reply bytes one server holds at once (limit 0: no limit)."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held(self) -> int:
        return self._held

    def admit(self, nbytes: int, what: str = "this call carries") -> None:
        """Count ``nbytes``, or raise ``ResourceExhausted`` when they do not fit."""
        with self._lock:
            limit = self.limit
            if limit and self._held + nbytes > limit:
                if nbytes > limit:
                    raise ResourceExhausted(
                        f"{what} {nbytes} bytes, over the server's limit of {limit} "
                        "bytes in flight; send smaller pieces"
                    )
                raise ResourceExhausted(
                    f"{what} {nbytes} bytes and only {limit - self._held} of the "
                    f"server's {limit} in-flight bytes are free; retry later"
                )
            self._held += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    def hold(self) -> InflightHold:
        return InflightHold(self)


class InflightHold:
    """What one call holds of an ``InflightBytes`` budget; ``release`` is idempotent,
    so both the end of a stream and the call's termination callback may call it."""

    def __init__(self, budget: InflightBytes) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self._nbytes = 0

    def admit(self, nbytes: int, what: str = "this call carries") -> None:
        self._budget.admit(nbytes, what)
        with self._lock:
            self._nbytes += nbytes

    def release(self) -> None:
        with self._lock:
            nbytes, self._nbytes = self._nbytes, 0
        if nbytes:
            self._budget.release(nbytes)


class LimitsInterceptor(HookInterceptor):
    """Counts in-flight bytes and open streams for one server."""

    def __init__(
        self,
        max_inflight_bytes: int = 0,
        max_concurrent_streams: int = 0,
        *,
        inflight: InflightBytes | None = None,
        stall: StallWatch | None = None,
    ):
        self.inflight = inflight or InflightBytes(max_inflight_bytes)
        self.max_concurrent_streams = max_concurrent_streams
        self.stall = stall
        self._lock = threading.Lock()
        self.streams = 0

    @property
    def max_inflight_bytes(self) -> int:
        return self.inflight.limit

    @property
    def inflight_bytes(self) -> int:
        return self.inflight.held

    def method_hooks(
        self, handler: Handler, called: tuple[str, str]
    ) -> CallHooks | None:
        return _Admission(
            self,
            called[1],
            bool(handler.request_streaming),
            bool(handler.response_streaming),
        )

    # -- admission -------------------------------------------------------------------
    def admit_stream(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            limit = self.max_concurrent_streams
            if limit and self.streams >= limit:
                refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is at its limit of {limit} concurrent streams; "
                    "retry later",
                    "STREAM_LIMIT",
                    {"limit": str(limit)},
                )
            self.streams += 1

    def admit_bytes(self, context: grpc.ServicerContext, nbytes: int) -> None:
        try:
            self.inflight.admit(nbytes)
        except ResourceExhausted as exc:
            why = str(exc)
        else:
            return
        metadata = {"limit": str(self.inflight.limit), "requested": str(nbytes)}
        refuse(
            context, grpc.StatusCode.RESOURCE_EXHAUSTED, why, "INFLIGHT_BYTES", metadata
        )

    def release(self, nbytes: int, stream: bool) -> None:
        self.inflight.release(nbytes)
        if stream:
            with self._lock:
                self.streams -= 1


def _on_data_channel(request: Any) -> bool:
    """A unary Push or Pull whose tensors travel on the data channel."""
    return isinstance(request, (pb.PushRequest, pb.PullRequest)) and request.HasField(
        "transfer"
    )


class _Admission(CallHooks):
    """The calls of one method: what each holds of the server's limits (in its
    ``Call``), from the size it was received with (``Plan.parse``).

    A stream is counted when its handler starts, before anything is read from it, so
    streams that never send still count; its bytes are admitted once its header has
    declared them.
    """

    __slots__ = ("limits", "method", "req_s", "stream")

    def __init__(
        self, limits: LimitsInterceptor, method: str, req_s: bool, resp_s: bool
    ) -> None:
        self.limits = limits
        self.method = method
        self.req_s = req_s
        self.stream = req_s or resp_s

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        if self.stream or _on_data_channel(request):
            self.limits.admit_stream(context)
            call.held_stream = True
        if self.req_s:
            # A standby's acknowledgements stop while its primary has nothing to
            # ship: an idle Replicate stream is not a stalled one, once its hello
            # came (one that never sends it would hold a thread and a stream slot,
            # which the shard's real standbys need, for ever).
            if self.limits.stall is not None:
                request = self.limits.stall.reading(
                    request, context, self.method,
                    first_only=self.method == "Replicate",
                )  # fmt: skip
            it = iter(request)
            first = next(it, None)
            if isinstance(first, Malformed):
                refuse(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    _malformed_message(first),
                    "MALFORMED_MESSAGE",
                )
            if first is None:
                return it
            nbytes, request = message_bytes(first), _checked(first, it)
        else:
            if isinstance(request, Malformed):
                refuse(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    _malformed_message(request),
                    "MALFORMED_MESSAGE",
                )
            nbytes = call.size
        self.limits.admit_bytes(context, nbytes)
        call.held_bytes = nbytes
        return request

    def finish(self, call: Call, context: grpc.ServicerContext, failed: bool) -> None:
        if call.held_stream or call.held_bytes:
            self.limits.release(call.held_bytes, call.held_stream)


# -- the graceful stop's gate ---------------------------------------------------------
REFUSAL = "the server is shutting down; retry (after it restarts or on another server)"


class DrainGate(HookInterceptor):
    """Counts the service's calls in flight; after ``close()`` refuses new ones."""

    def __init__(self) -> None:
        # every call takes the lock twice; only wait_idle waits on the condition
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running = 0
        self._closed = False
        self._idle_waiters = 0  # calls of wait_idle waiting now
        self._admitted = _Admitted(self)  # the hooks of every service method

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def close(self) -> None:
        """Answer every call that starts from now on with UNAVAILABLE."""
        with self._cond:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted call runs; False when ``timeout`` passed first."""
        end = time.monotonic() + timeout
        with self._cond:
            self._idle_waiters += 1
            try:
                while self._running:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._idle_waiters -= 1

    def method_hooks(
        self, handler: Handler, called: tuple[str, str]
    ) -> CallHooks | None:
        if called[0] != SERVICE:
            return None  # health and reflection: answered until the end
        return self._admitted

    def _enter(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._running += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running and self._idle_waiters:
                self._cond.notify_all()


class _Admitted(CallHooks):
    __slots__ = ("gate",)

    def __init__(self, gate: DrainGate) -> None:
        self.gate = gate

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        call.admitted = self.gate._enter()
        if not call.admitted:
            refuse(context, grpc.StatusCode.UNAVAILABLE, REFUSAL, "SHUTTING_DOWN")
        return request

    def finish(self, call: Call, context: grpc.ServicerContext, failed: bool) -> None:
        if call.admitted:
            call.admitted = False
            self.gate._leave()
