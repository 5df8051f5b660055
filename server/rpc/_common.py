"""What every RPC handler of the servicer shares: the decorators that turn errors
into statuses, the call's deadline, cancellation and caller, stream headers, and
``RpcFamily``, the base of the handler families (``_groups``, ``_tensors``,
``_rows``), which holds the parts the servicer was built with.

A caller that goes away (it cancels, or its deadline passes) is not a server error:
the call ends quietly (DEBUG), and what it held is dropped at once, its traceback's
frames too (grpc keeps the ``RpcError`` it raised into the servicer, so frames left on
it would keep a half-received push alive until the cycle collector runs). A call
that waits for a version learns through a ``Cancellation`` that its caller left.
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import (
    CHUNK_BYTES,
    TensorAssembler,
    TensorFormatError,
    deserializer,
    rpc_messages,
    serializer,
)

from ..durability import Durability, SaveResult
from ..errors import InvalidArgument
from ..interceptors._handlers import group_of, on_first
from ..interceptors._status import rich_status, status_of
from ..interceptors.limits import InflightBytes, InflightHold
from ..store import CURRENT_CALL, CallCancelled, CallLink, Cancellation, ParameterStore
from ..transports._datachannel import ChannelTable, principal_of
from ..transports._receive import GradientPool
from ..transports._shm import Caller, SharedMemory

__all__ = [
    "RpcFamily",
    "add_servicer",
    "caller_of",
    "cancellation_of",
    "failure",
    "names_of",
    "raise_if_cut_off",
    "stream_header",
    "streaming",
    "timeout_of",
    "unary",
]

log = logging.getLogger("onnxps.service")

Array = np.ndarray[Any, Any]

F = TypeVar("F", bound=Callable[..., Any])


# A wait ends this much before its call's deadline (at most a tenth of the time left).
_ANSWER_EARLY_SECONDS = 0.05


# A deadline further than this (about 30 years) is no deadline.
_NO_DEADLINE = 1e9


# How long a request stream that ended early is watched for its client's cancellation.
_CUT_OFF_SECONDS = 0.2


def failure(
    exc: BaseException,
    context: grpc.ServicerContext,
    method: str,
    group: str | None = None,
) -> grpc.Status:
    """The status an exception ends a call with (logged when it is a bug); a
    refusal of a call that names ``group`` says so in its ErrorInfo metadata."""
    kept = tuple(context.trailing_metadata() or ())  # e.g. the request id echo
    if isinstance(exc, (grpc.RpcError, CallCancelled)) or not context.is_active():
        _drop_frames(exc)
        log.debug("%s: the client went away (cancelled or out of time)", method)
        code = grpc.StatusCode.CANCELLED
        gone = "the client cancelled the call"
        return rich_status(code, gone, code.name, trailers=kept)
    status = status_of(exc, kept, group)
    if status is not None:
        return status
    log.exception("%s failed with an unexpected error", method)
    message = (
        f"internal error in {method}: {type(exc).__name__}: {exc} (a bug: the "
        "server log has the traceback)"
    )
    return rich_status(grpc.StatusCode.INTERNAL, message, "INTERNAL", trailers=kept)


def _drop_frames(exc: BaseException | None) -> None:
    """Free the locals of an exception's finished frames, and its chain's."""
    while exc is not None:
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _already_aborted(context: grpc.ServicerContext) -> bool:
    # grpc's context.abort raises a plain Exception after setting the status code.
    code = getattr(context, "code", None)
    return callable(code) and code() not in (None, grpc.StatusCode.OK)


class _Named:
    """The group a call names: its request's, or its request stream's first
    message's once read (the stream is handed on unchanged)."""

    def __init__(self, request: Any) -> None:
        self.group: str | None = None
        if isinstance(request, Iterator):
            self.request: Any = on_first(request, self._see)
        else:
            self.request = request
            self._see(request)

    def _see(self, msg: Any) -> None:
        self.group = group_of(msg) or None


def unary(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        # A request message names its group at once: looked up only on a failure.
        named = None if isinstance(request, Message) else _Named(request)
        link = CallLink(context)
        CURRENT_CALL.set(link)
        try:
            reply = method(self, request if named is None else named.request, context)
            _raise_if_unacknowledged(link)
            return reply
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            if _already_aborted(context):
                raise
            group = group_of(request) or None if named is None else named.group
            status = failure(exc, context, method.__name__, group)
        finally:
            _unlink(link)
        # Outside the except block, so the abort does not chain the error's frames.
        context.abort_with_status(status)

    return wrapper  # type: ignore[return-value]


def streaming(method: F) -> F:
    @functools.wraps(method)
    def wrapper(
        self: Any, request: Any, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        named = _Named(request)
        link = CallLink(context)
        CURRENT_CALL.set(link)
        try:
            yield from method(self, named.request, context)
            _raise_if_unacknowledged(link)
            return
        except Exception as exc:  # noqa: BLE001
            if _already_aborted(context):
                raise
            status = failure(exc, context, method.__name__, named.group)
        finally:
            _unlink(link)
        context.abort_with_status(status)

    return wrapper  # type: ignore[return-value]


def _raise_if_unacknowledged(link: CallLink) -> None:
    """A change the call made that its standbys did not acknowledge is not OK: it
    stays applied here (the log holds it), the reply says why."""
    if link.unacknowledged is not None:
        raise link.unacknowledged


def _unlink(link: CallLink) -> None:
    """The call ended: its thread serves other calls next. (A response stream's
    generator may be closed on another thread, serving another call then.)"""
    if CURRENT_CALL.get() is link:
        CURRENT_CALL.set(None)


def cancellation_of(context: grpc.ServicerContext) -> Cancellation:
    """Set when the call ends: it is cancelled, its deadline passes, or it is done."""
    gone = Cancellation()
    if not context.add_callback(gone.cancel):
        gone.cancel()  # the call has ended already
    return gone


def timeout_of(context: grpc.ServicerContext) -> float | None:
    """How long a wait may last: a little less than the call's deadline, so that the
    server's answer (what it waited for, the group's T) reaches the client before
    the client's own deadline fires with a bare DEADLINE_EXCEEDED."""
    left: float | None = context.time_remaining()
    if left is None or left > _NO_DEADLINE:
        # grpc's stubs say float; without a deadline it is None, or (grpcio 1.6x
        # and later) ~9.2e18 s, which no clock or socket timeout can hold
        return None
    return max(0.0, left - min(_ANSWER_EARLY_SECONDS, left / 10))


def caller_of(context: grpc.ServicerContext) -> Caller:
    """Who makes the call, as shared-memory segments are bound to it."""
    return Caller(principal_of(context.invocation_metadata()), context.peer())


def raise_if_cut_off(context: grpc.ServicerContext) -> None:
    """A request stream ended early: raise ``CallCancelled`` if its client went away.

    When a client cancels (or runs out of time) mid-stream, the server may see the
    end of the stream a moment before it sees the cancellation; a short look tells
    the two apart, and only a stream that ended early pays for it.
    """
    deadline = time.monotonic() + _CUT_OFF_SECONDS
    while context.is_active():
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)
    raise CallCancelled("the client went away in the middle of its stream")


def stream_header(
    request_iterator: Iterable[Any], part: str, rpc: str, context: Any
) -> tuple[Any, Iterator[Any]]:
    """A stream's header message and the iterator over the chunks after it."""
    it = iter(request_iterator)
    first = next(it, None)
    if first is None:
        raise_if_cut_off(context)
    if first is None or first.WhichOneof("part") != part:
        what = "header" if part == "header" else f"{part} header"
        raise InvalidArgument(f"{rpc} must begin with its {what}")
    return getattr(first, part), it


def names_of(prefix: str, n: int, names: Sequence[str] | None = None) -> list[str]:
    if names is not None:
        return [f"{prefix}_{i + 1} ({name!r})" for i, name in enumerate(names)]
    return [f"{prefix}_{i + 1}" for i in range(n)]


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(
    servicer: pb_grpc.ParameterServerServiceServicer, server: grpc.Server
) -> dict[str, Any]:
    """Serve ``servicer``'s RPCs on ``server`` (what the generated
    ``add_ParameterServerServiceServicer_to_server`` does), with the chunk-frame
    codec on the streams: received chunks are views (``codec.RawChunk``), and
    encoded frames (``codec.chunk_frames``) are sent as they are. Returns the
    handlers by method name."""
    handlers = {}
    for method in _SERVICE.methods_by_name:
        request, reply, req_s, resp_s = rpc_messages(method)
        handlers[method] = _FACTORIES[req_s, resp_s](
            getattr(servicer, method),
            request_deserializer=deserializer(request),
            response_serializer=serializer(reply),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),)
    )
    # grpc's stubs do not declare it yet; the generated code calls it too
    server.add_registered_method_handlers(  # type: ignore[attr-defined]
        _SERVICE.full_name, handlers
    )
    return handlers


(_SERVICE,) = pb.DESCRIPTOR.services_by_name.values()


class RpcFamily:
    """The parts every handler family works over (one set, shared by the families
    the servicer is made of)."""

    def __init__(
        self,
        store: ParameterStore,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        save: Callable[[], SaveResult] | None = None,
        durability: Durability | None = None,
        inflight: InflightBytes | None = None,
        gradient_pool: GradientPool | None = None,
        shared_memory: SharedMemory | None = None,
        data_channels: ChannelTable | None = None,
    ) -> None:
        self.store = store
        # The same-host transport (off when not given).
        self._shm = shared_memory or SharedMemory(enabled=False)
        # Tensor bytes on sockets beside gRPC (none when not given).
        self._data = data_channels
        self.chunk_bytes = chunk_bytes
        self._save = save
        # A group's past (Rewind, Fork, History); None: no data directory.
        self._durability = durability
        # Pull replies are counted in the same budget as requests (see limits).
        self._inflight = inflight or InflightBytes()
        # Streamed pushes receive their gradients into buffers reused per group.
        self.gradient_pool = gradient_pool or GradientPool()

    def _assemble(
        self,
        it: Iterator[Any],
        headers: Sequence[pb.Tensor],
        names: Sequence[str],
        context: Any,
        *,
        encoded: bool = False,
    ) -> list[Array]:
        """The tensors of a stream; with ``encoded``, encoded ones widened."""
        asm = TensorAssembler(headers, names, encoded=encoded)
        for msg in it:
            if msg.WhichOneof("part") != "chunk":
                raise InvalidArgument("after the header a stream carries only chunks")
            asm.add(msg.chunk)
        try:
            return asm.finish()
        except TensorFormatError:
            raise_if_cut_off(context)
            raise

    @contextmanager
    def _reply_bytes(self, context: Any, stream: bool) -> Iterator[InflightHold]:
        """What a pull's reply holds of the in-flight budget: released when the call
        ends (its termination callback), when it fails, or when its stream ends."""
        hold = self._inflight.hold()
        # refused: the call has ended already, nothing will run the callback
        registered = context.add_callback(hold.release)
        try:
            yield hold
        except BaseException:
            hold.release()
            raise
        if stream or not registered:
            hold.release()
