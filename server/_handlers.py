"""Helpers shared by the server interceptors (auth, limits, observability).

A ``grpc.ServerInterceptor`` can only hand back an ``RpcMethodHandler``; these helpers
rebuild a handler of the same kind around a new behavior, find the method and group of
a call, and peek at the first message of a request stream without losing it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message
from onnxps.client.codec import SERVICE as _SERVICE

__all__ = [
    "SERVICE",
    "Malformed",
    "group_of",
    "method_of",
    "peek",
    "rewrap",
]

SERVICE = _SERVICE  # from the descriptor, derived once in the shared codec

Behavior = Callable[..., Any]


class Malformed:
    """Stands in for a request message whose bytes did not parse.

    gRPC answers an undecodable request with INTERNAL; the limits interceptor turns
    this placeholder into INVALID_ARGUMENT instead (the client sent garbage, not us).
    """

    __slots__ = ("error", "size")

    def __init__(self, size: int, error: str) -> None:
        self.size = size
        self.error = error

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf spelling
        return self.size


def method_of(handler_call_details: grpc.HandlerCallDetails) -> tuple[str, str]:
    """``(service, method)`` from ``/onnxps.v1.ParameterServerService/Push``."""
    full = handler_call_details.method or ""
    service, _, name = full.lstrip("/").partition("/")
    return service, name


def group_of(msg: Any) -> str | None:
    """The group a request or a stream's first message names (None: none)."""
    if not isinstance(msg, Message):
        return None
    fields = msg.DESCRIPTOR.fields_by_name
    if "header" in fields:
        if msg.WhichOneof("part") != "header":
            return None
        msg = msg.header
        fields = msg.DESCRIPTOR.fields_by_name
    if "group" in fields:
        return str(msg.group)
    return None


def peek(iterator: Iterator[Any]) -> tuple[Any, Iterator[Any]]:
    """The first item (None if empty) and an iterator that still yields it."""
    first = next(iterator, None)
    if first is None:
        return None, iter(())
    return first, itertools.chain((first,), iterator)


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler) -> Behavior:
    return (
        handler.unary_unary
        or handler.unary_stream
        or handler.stream_unary
        or handler.stream_stream
    )


def rewrap(
    handler: grpc.RpcMethodHandler | None,
    make: Callable[[Behavior, bool, bool], Behavior] | None,
    request_deserializer: Callable[[bytes], Any] | None = None,
    response_serializer: Callable[[Any], bytes] | None = None,
) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind whose behavior is ``make(behavior, req_s, resp_s)``
    (the same behavior when ``make`` is None), with the (de)serializers given.

    ``make`` must return a generator function when the response streams.
    """
    if handler is None:
        return None
    kind = (bool(handler.request_streaming), bool(handler.response_streaming))
    behavior = behavior_of(handler)
    new = behavior if make is None else make(behavior, *kind)
    return _FACTORIES[kind](
        new,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=response_serializer or handler.response_serializer,
    )
