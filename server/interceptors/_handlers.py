"""What the server interceptors (auth, limits, observability, chunk codec) share.

A ``grpc.ServerInterceptor`` can only hand back an ``RpcMethodHandler``. The
``HookChain`` lays out, once per method, the hooks that apply to it as a ``Plan``
(each phase only the hooks that do something in it) and hands grpc, per call, a
handler of the same kind running that plan around the original behavior with a
new ``Call`` record bound in: what a call holds travels with it, nothing is kept
in a process-wide table. A frame call runs the same plan (``Plan.call_frame``).
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


class Call:
    """One call as the chain and its hooks see it: a new record per call, while
    the hooks are shared by every call of a method (``HookChain.plan``). Each
    hook keeps what it holds of the call here, in the slots named for it."""

    __slots__ = (
        "admitted",
        "bytes_out",
        "first",
        "held_bytes",
        "held_stream",
        "metadata",
        "reply",
        "request_id",
        "size",
        "start",
    )

    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata  # the call's invocation metadata
        self.size = 0  # request bytes received (every message of a stream)
        self.first: Any = None  # the unary request, or a stream's first message
        self.reply: Any = None  # the (last) reply, as the outermost hook saw it
        # observing (``metrics``): when the call began, its id, the bytes a
        # response stream sent
        self.start = 0.0
        self.request_id = ""
        self.bytes_out = 0
        self.admitted = False  # the drain gate counted it (``limits.DrainGate``)
        self.held_stream = False  # limits: it counts as a stream,
        self.held_bytes = 0  # and holds these in-flight bytes

    def see_first(self, msg: Any) -> None:
        self.first = msg


class CallHooks:
    """What an interceptor does around the calls of one method (shared by them;
    what one call holds is kept in its ``Call``). Only the phases a class
    overrides run.

    ``before`` runs on the handler's thread before the behavior, with the request: a
    message, or for a request stream an iterator nothing has been read from. It
    returns the request to pass on (or aborts). Reading from a stream there blocks the
    thread until the client sends, so only hooks that run after authentication and
    the stream limit may do it. ``reply`` sees each response message; ``finish``
    runs last, whether the call succeeded (``failed`` False) or not.
    """

    __slots__ = ()

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        return request

    def reply(self, call: Call, msg: Any) -> Any:
        return msg

    def finish(self, call: Call, context: grpc.ServicerContext, failed: bool) -> None:
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
    """What one concern (observing, draining, tokens, shard, limits) adds around
    the calls of a method. Most decide once per method (``method_hooks``, asked
    when the method is first called); one that decides from a call's metadata
    (``reads_metadata``: tokens, shard routing) is asked per call
    (``call_hooks``). They run together as one ``HookChain``."""

    reads_metadata = False

    def method_hooks(
        self, handler: Handler, called: tuple[str, str]
    ) -> CallHooks | None:
        """The hooks of every call of this method (None: none). ``called`` is
        its ``(service, method)``."""
        return None

    def call_hooks(
        self, handler: Handler, called: tuple[str, str], metadata: Any
    ) -> CallHooks | None:
        """This call's hooks from its metadata (None: none); a ``Refusal`` ends
        the call before its request is read. The same metadata must give the
        same decision (a call channel keeps it for all its calls)."""
        return None


class HookChain(Interceptor):
    """The hook interceptors (outermost first) as one grpc interceptor.

    Once per method, the hooks that apply to it are laid out as a ``Plan``: each
    phase a list of only the hooks that do something in it, run in the order
    nested interceptors would (``before`` outermost first; ``reply`` and
    ``finish`` innermost first; ``finish`` only for the hooks ``before`` reached).
    A call asks only the metadata readers (tokens, shard) for its own part."""

    def __init__(self, parts: list[HookInterceptor]) -> None:
        self.parts = list(parts)
        self._methods: dict[str, _Method] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        plan = self.plan(handler, handler_call_details)
        return plan.handler(handler_call_details.invocation_metadata)

    def plan(self, handler: Handler, details: grpc.HandlerCallDetails) -> Plan:
        """The plan of a call of ``handler`` with this metadata (a frame call's
        server, whose channel's metadata is fixed, keeps it for the channel)."""
        name = details.method or ""
        method = self._methods.get(name)
        if method is None or method.handler is not handler:
            method = self._methods[name] = self._method(handler, name)
        if not method.asks:
            return method.plan
        hooks = list(method.hooks)
        metadata = details.invocation_metadata
        for i in method.asks:
            hooks[i] = self.parts[i].call_hooks(handler, method.called, metadata)
        key = tuple(hooks)
        plan = method.composed.get(key)
        if plan is None:
            plan = Plan(handler, method.called, [h for h in hooks if h is not None])
            if plan.refusal is None and len(method.composed) < _MAX_COMPOSED:
                method.composed[key] = plan
        return plan

    def _method(self, handler: Handler, name: str) -> _Method:
        called = _split_method(name)
        hooks: list[CallHooks | None] = []
        asks = []
        for i, part in enumerate(self.parts):
            if part.reads_metadata:
                asks.append(i)
                hooks.append(None)
            else:
                hooks.append(part.method_hooks(handler, called))
        plan = Plan(handler, called, [h for h in hooks if h is not None])
        return _Method(handler, called, hooks, tuple(asks), plan)


_MAX_COMPOSED = 256  # plans kept per method, one per token (and shard) decision


class _Method:
    __slots__ = ("asks", "called", "composed", "handler", "hooks", "plan")

    def __init__(
        self,
        handler: Handler,
        called: tuple[str, str],
        hooks: list[CallHooks | None],
        asks: tuple[int, ...],
        plan: Plan,
    ) -> None:
        self.handler = handler
        self.called = called
        self.hooks = hooks  # None where a metadata reader decides per call
        self.asks = asks
        self.plan = plan  # when no part reads metadata
        self.composed: dict[tuple[CallHooks | None, ...], Plan] = {}


def _runs(hooks: CallHooks, phase: str) -> bool:
    return getattr(type(hooks), phase) is not getattr(CallHooks, phase)


class Plan:
    """The hooks of one method's calls, phase by phase (``HookChain.plan``).

    ``befores`` pairs each hook that has a ``before`` with how many hooks have
    been entered once it runs; ``finishes`` pairs each hook that has a
    ``finish`` with its place, innermost first. A refused plan ends with its
    ``Refusal`` and never reads the request."""

    __slots__ = (
        "befores",
        "behavior",
        "count",
        "deserialize",
        "finishes",
        "hooked",
        "method",
        "original",
        "refusal",
        "replies",
        "resp_s",
        "serialize",
    )

    def __init__(
        self, handler: Handler, called: tuple[str, str], hooks: list[CallHooks]
    ) -> None:
        self.original = handler
        self.method = called[1]
        self.behavior = _behavior_of(handler)
        self.deserialize: Deserializer | None = handler.request_deserializer
        self.serialize: Serializer | None = handler.response_serializer
        self.resp_s = bool(handler.response_streaming)
        self.refusal: int | None = None
        for i, hook in enumerate(hooks):
            if isinstance(hook, Refusal):  # decided now: the inner hooks never run
                self.refusal = i
                hooks = hooks[: i + 1]
                break
        self.count = len(hooks)
        self.hooked = bool(hooks)
        self.befores = [
            (i + 1, hook.before)
            for i, hook in enumerate(hooks)
            if _runs(hook, "before")
        ]
        self.replies = [h.reply for h in reversed(hooks) if _runs(h, "reply")]
        self.finishes = [
            (i, hook.finish)
            for i, hook in reversed(list(enumerate(hooks)))
            if _runs(hook, "finish")
        ]

    def handler(self, metadata: Any) -> Handler:
        """A grpc handler for one call (its ``Call`` bound in), of the method's
        kind; a refused call's is a request stream nothing reads."""
        if not self.hooked:
            return self.original
        call = Call(metadata)
        handler = self.original
        req_s = bool(handler.request_streaming)
        if self.refusal is not None:
            req_s = True
            refuse = self.refuse_streaming if self.resp_s else self.refuse
            run: Behavior = functools.partial(refuse, call)
        elif self.resp_s:
            run = functools.partial(self.run_streaming, call)
        else:
            run = functools.partial(self.run, call)
        behaviors: list[Behavior | None] = [None, None, None, None]
        behaviors[2 * req_s + self.resp_s] = run
        parse = self.deserialize
        if parse is not None and self.refusal is None:
            parse = functools.partial(self.parse, call)
        return _RpcHandler(  # type: ignore[no-any-return]
            req_s, self.resp_s, parse, self.serialize, *behaviors
        )

    def call_frame(self, raw: bytes, context: Any, metadata: Any) -> Any:
        """One unary call whose request bytes the server holds (a frame call):
        parsed and run with the hooks around it; its reply."""
        call = Call(metadata)
        if self.refusal is not None:
            return self.refuse(call, None, context)
        return self.run(call, self.parse(call, raw), context)

    def parse(self, call: Call, raw: bytes) -> Any:
        """A request message from its bytes, counted in ``call.size``; bytes that
        do not parse give a ``Malformed`` the limits hooks answer."""
        call.size += len(raw)
        assert self.deserialize is not None
        try:
            if raw[:1] == b"\x00":  # field 0: upb lets a fieldless message take it
                raise ValueError("field number 0 is not a valid tag")
            return self.deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
            return Malformed(len(raw), f"{self.method}: {exc}")

    def run(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        """A call with a unary response, the hooks around its behavior."""
        entered = 0
        failed = True
        try:
            for entered, before in self.befores:  # noqa: B007 - read in finally
                request = before(call, request, context)
            entered = self.count
            reply = self.behavior(request, context)
            for hook in self.replies:
                reply = hook(call, reply)
            call.reply = reply
            failed = False
            return reply
        finally:
            self.finish(call, context, failed, entered)

    def run_streaming(
        self, call: Call, request: Any, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        """A call with a response stream, the hooks around its behavior."""
        entered = 0
        failed = True
        try:
            for entered, before in self.befores:  # noqa: B007 - read in finally
                request = before(call, request, context)
            entered = self.count
            replies = self.replies
            for msg in self.behavior(request, context):
                for hook in replies:
                    msg = hook(call, msg)
                call.reply = msg
                yield msg
            failed = False
        finally:
            self.finish(call, context, failed, entered)

    def refuse(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        """A refused call: the hooks up to its ``Refusal``, whose ``before``
        aborts; the request is never read."""
        entered = 0
        try:
            for entered, before in self.befores:  # noqa: B007 - read in finally
                before(call, None, context)
            raise AssertionError("a Refusal's before aborts its call")
        finally:
            self.finish(call, context, True, entered)

    def refuse_streaming(
        self, call: Call, request: Any, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        yield self.refuse(call, request, context)

    def finish(
        self, call: Call, context: grpc.ServicerContext, failed: bool, entered: int
    ) -> None:
        """The ``finish`` of the hooks entered, innermost first; each runs even
        when one before it raised (the first error is raised after)."""
        error: BaseException | None = None
        for place, finish in self.finishes:
            if place < entered:
                try:
                    finish(call, context, failed)
                except BaseException as exc:  # noqa: BLE001 - the others finish too
                    error = error or exc
        if error is not None:
            raise error
