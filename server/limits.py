"""Backpressure: bounded in-flight bytes and streams, and undecodable requests.

The interceptor refuses work it cannot hold instead of queueing it: a call whose bytes
would take the server over ``max_inflight_bytes``, or a stream beyond
``max_concurrent_streams``, fails at once with RESOURCE_EXHAUSTED. The bytes of a call
are the size of a unary request, or for a request stream the size of its header plus
the tensor bytes the header declares (what the server will preallocate), counted before
anything is allocated. A request whose bytes do not parse gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message
from onnxps.client.codec import PROTO_TO_DTYPE
from onnxps.v1 import parameter_server_pb2 as pb

from ._handlers import Behavior, Malformed, method_of, peek, rewrap
from .errors import InvalidArgument

__all__ = ["LimitsInterceptor", "declared_bytes", "interceptors"]


def interceptors(config: Any) -> list[grpc.ServerInterceptor]:
    return [
        LimitsInterceptor(
            max_inflight_bytes=getattr(config, "max_inflight_bytes", 0),
            max_concurrent_streams=getattr(config, "max_concurrent_streams", 0),
        )
    ]


def _tensor_bytes(t: pb.Tensor) -> int:
    dtype = PROTO_TO_DTYPE.get(t.dtype)
    if dtype is None or any(d < 0 for d in t.dims):
        return 0  # the servicer rejects it with INVALID_ARGUMENT
    return math.prod(t.dims) * dtype.itemsize


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
    return total


# Wire sizes of parsed requests by id(message), noted by the deserializer: grpc parses
# on another thread than the handler's. Bounded: entries whose handler never asked
# (a call refused earlier) are evicted; a reused id is overwritten at its next parse.
_received: OrderedDict[int, int] = OrderedDict()
_received_lock = threading.Lock()
_RECEIVED_MAX = 4096


def _note_received(msg: Any, size: int) -> None:
    with _received_lock:
        _received[id(msg)] = size
        while len(_received) > _RECEIVED_MAX:
            _received.popitem(last=False)


def received_bytes(msg: Any, *, forget: bool = False) -> int:
    """The size of a request as received (no re-encoding)."""
    with _received_lock:
        size = _received.pop(id(msg), None) if forget else _received.get(id(msg))
    return message_bytes(msg) if size is None else size


def message_bytes(msg: Any) -> int:
    """About the wire size of a message, without encoding a large one.

    ``ByteSize()`` serializes the whole message in upb (~170 ms for 64 MiB), so a
    message that carries tensors is sized from their declared dims instead.
    """
    if isinstance(msg, Malformed):
        return msg.size
    if not isinstance(msg, Message):
        return 0
    declared = declared_bytes(msg)
    return declared + 256 if declared else msg.ByteSize()


def _tolerant(
    deserialize: Callable[[bytes], Any] | None, method: str
) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            if raw[:1] == b"\x00":  # field 0: upb lets a fieldless message take it
                raise ValueError("field number 0 is not a valid tag")
            msg = deserialize(raw)
            _note_received(msg, len(raw))
            return msg
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
            return Malformed(len(raw), f"{method}: {exc}")

    return parse


def _malformed_message(m: Malformed) -> str:
    return (
        f"the request of {m.error.partition(':')[0]} is not a valid protobuf message "
        f"({m.size} bytes): {m.error.partition(': ')[2]}"
    )


def _checked(it: Iterator[Any]) -> Iterator[Any]:
    for msg in it:
        if isinstance(msg, Malformed):
            # Raised inside the servicer, which maps it to INVALID_ARGUMENT.
            raise InvalidArgument(_malformed_message(msg))
        yield msg


class LimitsInterceptor(grpc.ServerInterceptor):
    def __init__(self, max_inflight_bytes: int = 0, max_concurrent_streams: int = 0):
        self.max_inflight_bytes = max_inflight_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self._lock = threading.Lock()
        self.inflight_bytes = 0
        self.streams = 0

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        _, method = method_of(handler_call_details)
        return rewrap(
            handler,
            self._make,
            _tolerant(handler.request_deserializer, method),
        )

    # -- admission -------------------------------------------------------------------
    def _admit(self, context: grpc.ServicerContext, nbytes: int, stream: bool) -> None:
        with self._lock:
            if stream and self.max_concurrent_streams:
                if self.streams >= self.max_concurrent_streams:
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the server is at its limit of {self.max_concurrent_streams} "
                        "concurrent streams; retry later",
                    )
            limit = self.max_inflight_bytes
            if limit and self.inflight_bytes + nbytes > limit:
                if nbytes > limit:
                    why = (
                        f"this call carries {nbytes} bytes, over the server's limit of "
                        f"{limit} bytes in flight; send smaller pieces"
                    )
                else:
                    why = (
                        f"this call carries {nbytes} bytes and only "
                        f"{limit - self.inflight_bytes} of the server's {limit} "
                        "in-flight bytes are free; retry later"
                    )
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            self.inflight_bytes += nbytes
            if stream:
                self.streams += 1

    def _release(self, nbytes: int, stream: bool) -> None:
        with self._lock:
            self.inflight_bytes -= nbytes
            if stream:
                self.streams -= 1

    def _prepare(
        self, request: Any, context: grpc.ServicerContext, request_streaming: bool
    ) -> tuple[Any, int]:
        """Refuse undecodable input; return the request (re-chained) and its bytes."""
        if request_streaming:
            first, it = peek(request)
            if isinstance(first, Malformed):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(first)
                )
            if first is None:
                return it, 0
            return _checked(it), message_bytes(first)
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
        return request, received_bytes(request, forget=True)

    def _make(self, behavior: Behavior, req_s: bool, resp_s: bool) -> Behavior:
        stream = req_s or resp_s
        if resp_s:

            def call_streaming(request: Any, context: grpc.ServicerContext) -> Any:
                request, nbytes = self._prepare(request, context, req_s)
                self._admit(context, nbytes, stream)
                try:
                    yield from behavior(request, context)
                finally:
                    self._release(nbytes, stream)

            return call_streaming

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            request, nbytes = self._prepare(request, context, req_s)
            self._admit(context, nbytes, stream)
            try:
                return behavior(request, context)
            finally:
                self._release(nbytes, stream)

        return call
