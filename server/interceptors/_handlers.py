"""What the server interceptors (auth, limits, observability, chunk codec) share.

A ``grpc.ServerInterceptor`` can only hand back an ``RpcMethodHandler``. ``wrap``
builds one of the same kind around the original behavior with a ``CallHooks``
object: ``intercept_service`` runs once per call, so the hooks (and any request
deserializer made there) belong to that call alone and carry its data; nothing is
kept in a process-wide table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message
from onnxps.wire.codec import SERVICE as _SERVICE

__all__ = [
    "SERVICE",
    "CallHooks",
    "HookChain",
    "HookInterceptor",
    "Malformed",
    "Refusal",
    "group_of",
    "method_of",
    "on_first",
    "refused",
    "wrap",
]

SERVICE = _SERVICE  # from the descriptor, derived once in the shared codec

Behavior = Callable[..., Any]
if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]
    Interceptor = grpc.ServerInterceptor[Any, Any]
else:  # grpc's classes are not generic at run time; only its stubs are
    Handler = grpc.RpcMethodHandler
    Interceptor = grpc.ServerInterceptor
Deserializer = Callable[[bytes], Any]
Serializer = Callable[[Any], bytes]


class Malformed:
    """Stands in for a request message whose bytes did not parse.

    gRPC answers an undecodable request with INTERNAL; the limits interceptor turns
    this placeholder into INVALID_ARGUMENT instead (the client sent garbage, not us).
    """

    __slots__ = ("error", "size")

    def __init__(self, size: int, error: str) -> None:
        self.size = size
        self.error = error


class CallHooks:
    """What an interceptor does around one call (a new instance per call).

    ``before`` runs on the handler's thread before the behavior, with the request: a
    message, or for a request stream an iterator nothing has been read from. It
    returns the request to pass on (or aborts). Reading from a stream there blocks the
    thread until the client sends, so only hooks that run after authentication and
    the stream limit may do it. ``reply`` sees each response message; ``finish``
    runs last, whether the call succeeded (``failed`` False) or not.
    """

    __slots__ = ()

    def before(self, request: Any, context: grpc.ServicerContext) -> Any:
        return request

    def reply(self, msg: Any) -> Any:
        return msg

    def finish(self, context: grpc.ServicerContext, failed: bool) -> None:
        return None


class Refusal(CallHooks):
    """Hooks that refuse their call from its metadata alone (``before`` aborts).

    gRPC receives a unary request whole, up to ``max_message_bytes``, before the
    behavior runs, and Python copies it again to deserialize it. So the chain serves a
    refused call as a request stream that nothing reads: its status goes out at once
    and its request is never received (a caller without a token cannot make the
    server hold its bytes).
    """

    __slots__ = ()


# The class grpc's handler factories build (a named tuple of the eight fields),
# built directly: a call is wrapped on every RPC.
_RpcHandler: Any = type(grpc.unary_unary_rpc_method_handler(lambda r, c: r))


def _behavior_of(handler: Handler) -> Behavior:
    behavior = (
        handler.unary_unary
        or handler.unary_stream
        or handler.stream_unary
        or handler.stream_stream
    )
    assert behavior is not None, "a handler always has one behavior"
    return behavior


def _hooked(behavior: Behavior, hooks: CallHooks, resp_s: bool) -> Behavior:
    if resp_s:

        def call_streaming(request: Any, context: grpc.ServicerContext) -> Any:
            failed = True
            try:
                request = hooks.before(request, context)
                for msg in behavior(request, context):
                    yield hooks.reply(msg)
                failed = False
            finally:
                hooks.finish(context, failed)

        return call_streaming

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        failed = True
        try:
            request = hooks.before(request, context)
            reply = hooks.reply(behavior(request, context))
            failed = False
            return reply
        finally:
            hooks.finish(context, failed)

    return call


def _unread(hooks: CallHooks, resp_s: bool) -> Behavior:
    """A request-streaming behavior that runs ``hooks`` (ending in a ``Refusal``)
    without reading the request: they see None as the request."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        failed = True
        try:
            hooks.before(None, context)
            raise AssertionError("a Refusal's before aborts its call")
        finally:
            hooks.finish(context, failed)

    if not resp_s:
        return refuse

    def refuse_streaming(request: Any, context: grpc.ServicerContext) -> Any:
        yield from refuse(request, context)

    return refuse_streaming


def refused(handler: Handler, hooks: CallHooks) -> Handler:
    """A handler that runs ``hooks`` and never receives the call's request (a
    request stream of the same response kind as ``handler``)."""
    resp_s = bool(handler.response_streaming)
    behaviors: list[Behavior | None] = [None, None, None, None]
    behaviors[2 + resp_s] = _unread(hooks, resp_s)
    return _RpcHandler(  # type: ignore[no-any-return]
        True,
        resp_s,
        handler.request_deserializer,
        handler.response_serializer,
        *behaviors,
    )


def wrap(
    handler: Handler | None,
    hooks: CallHooks | None = None,
    *,
    request_deserializer: Deserializer | None = None,
    response_serializer: Serializer | None = None,
) -> Handler | None:
    """A handler of the same kind running ``hooks`` around the behavior (the same
    behavior when None), with the (de)serializers given (else the handler's own)."""
    if handler is None:
        return None
    req_s = bool(handler.request_streaming)
    resp_s = bool(handler.response_streaming)
    behavior = _behavior_of(handler)
    if hooks is not None:
        behavior = _hooked(behavior, hooks, resp_s)
    behaviors: list[Behavior | None] = [None, None, None, None]
    behaviors[2 * req_s + resp_s] = behavior
    return _RpcHandler(  # type: ignore[no-any-return]
        req_s,
        resp_s,
        request_deserializer or handler.request_deserializer,
        response_serializer or handler.response_serializer,
        *behaviors,
    )


def method_of(handler_call_details: grpc.HandlerCallDetails) -> tuple[str, str]:
    """``(service, method)`` from ``/onnxps.v1.ParameterServerService/Push``."""
    return _split_method(handler_call_details.method or "")


@functools.lru_cache(maxsize=256)
def _split_method(full: str) -> tuple[str, str]:
    service, _, name = full.lstrip("/").partition("/")
    return service, name


# How a message type names its group: ("group",), ("header", "group") through a
# stream's header part, or () when it names none; one entry per message type.
_GROUP_PATHS: dict[Any, tuple[str, ...]] = {}


def _group_path(descriptor: Any) -> tuple[str, ...]:
    fields = descriptor.fields_by_name
    if "header" in fields:
        header = fields["header"].message_type
        if header is not None and "group" in header.fields_by_name:
            return ("header", "group")
        return ()
    return ("group",) if "group" in fields else ()


def group_of(msg: Any) -> str | None:
    """The group a request or a stream's first message names (None: none)."""
    if not isinstance(msg, Message):
        return None
    descriptor = msg.DESCRIPTOR
    path = _GROUP_PATHS.get(descriptor)
    if path is None:
        path = _GROUP_PATHS[descriptor] = _group_path(descriptor)
    if not path:
        return None
    named: Any = msg  # a request type that has these fields
    if len(path) == 2:
        if named.WhichOneof("part") != "header":
            return None
        named = named.header
    return str(named.group)


def on_first(iterator: Iterator[Any], see: Callable[[Any], None]) -> Iterator[Any]:
    """``iterator`` unchanged, calling ``see`` on its first item when it is read
    (not before: nothing here waits for the client)."""
    it = iter(iterator)
    for first in it:
        see(first)
        yield first
        break
    yield from it


class HookInterceptor:
    """What one concern (observing, draining, tokens, shard, limits) adds around a
    call: its hooks (``call_hooks``), and maybe a deserializer of its own wrapping the
    one it is given. They run together as one ``HookChain``."""

    def call_hooks(
        self,
        handler: Handler,
        handler_call_details: grpc.HandlerCallDetails,
        deserializer: Deserializer | None,
        called: tuple[str, str],
    ) -> tuple[CallHooks | None, Deserializer | None]:
        """This call's hooks (None: none), and the deserializer to read its
        request with (None: ``deserializer`` as it is). ``called`` is the call's
        ``(service, method)``, split once for the whole chain."""
        raise NotImplementedError


class HookChain(Interceptor):
    """The hook interceptors (outermost first) as one grpc interceptor: each call
    is wrapped once, with one hooks object that runs theirs in the order nested
    interceptors would (``before`` outermost first; ``reply`` and ``finish``
    innermost first; ``finish`` only for the hooks whose ``before`` ran)."""

    def __init__(self, parts: list[HookInterceptor]) -> None:
        self.parts = list(parts)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self.wrap_call(handler, handler_call_details)

    def wrap_call(
        self, handler: Handler, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        """``handler`` with this call's hooks around it (``intercept_service``
        once the handler is found; a frame call, whose server has it, asks here
        directly)."""
        original = deserializer = handler.request_deserializer
        hooks: list[CallHooks] = []
        called = _split_method(handler_call_details.method or "")
        for part in reversed(self.parts):  # innermost first: its reader is inner
            got, parse = part.call_hooks(
                handler, handler_call_details, deserializer, called
            )
            if parse is not None:
                deserializer = parse
            if got is not None:
                hooks.append(got)
        if not hooks and deserializer is original:
            return handler
        hooks.reverse()
        for i, got in enumerate(hooks):
            if isinstance(got, Refusal):  # decided now: the inner hooks never run
                return refused(handler, _chain(hooks[: i + 1]))
        chained = _chain(hooks) if hooks else None
        wrapped = wrap(handler, chained, request_deserializer=deserializer)
        assert wrapped is not None  # (wrap gives None for a None handler only)
        return wrapped


def _chain(hooks: list[CallHooks]) -> CallHooks:
    return hooks[0] if len(hooks) == 1 else _Chained(hooks)


_PASS_REPLY = CallHooks.reply


class _Chained(CallHooks):
    """Several interceptors' hooks of one call, as their nesting would run them."""

    __slots__ = ("entered", "hooks")

    def __init__(self, hooks: list[CallHooks]) -> None:
        self.hooks = hooks
        self.entered = 0

    def before(self, request: Any, context: grpc.ServicerContext) -> Any:
        for hooks in self.hooks:
            self.entered += 1
            request = hooks.before(request, context)
        return request

    def reply(self, msg: Any) -> Any:
        for hooks in reversed(self.hooks):
            if type(hooks).reply is not _PASS_REPLY:  # most hooks pass it on
                msg = hooks.reply(msg)
        return msg

    def finish(self, context: grpc.ServicerContext, failed: bool) -> None:
        error: BaseException | None = None
        for hooks in reversed(self.hooks[: self.entered]):
            try:
                hooks.finish(context, failed)
            except BaseException as exc:  # noqa: BLE001 - the others finish too
                error = error or exc
        if error is not None:
            raise error
