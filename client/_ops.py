"""Operations and their effects: the one model both clients run.

Every call is an *operation*: a generator that builds its requests, yields the
effects it needs (``Call``: one RPC; ``Pause``: wait before a resend; ``Parallel``:
run several operations at once, e.g. one per shard of a cluster; ``Transfer``: an RPC
whose tensors travel on a data channel; ``Blocking``: a step that is not an RPC) and
returns the decoded reply. ``Client`` performs the effects with blocking grpc calls
(and a thread pool) and ``AsyncClient`` with ``grpc.aio`` coroutines (and tasks);
neither knows anything about a request or a reply. Operations compose with
``yield from``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, overload

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    TensorAssembler,
    TensorFormatError,
)
from onnxps.wire.encoding import Encoding

from ._datachannel import DataChannel
from ._errors import DeadlineExceededError, RpcError, UnavailableError, translate

__all__ = [
    "Blocking",
    "Call",
    "Deadline",
    "Effect",
    "Op",
    "OpRun",
    "Parallel",
    "Pause",
    "PushCall",
    "StreamReader",
    "TensorStreamReader",
    "Transfer",
    "as_method",
    "on_shard",
    "parallel",
    "one_call",
    "unary_call",
    "unary_request",
    "what",
]

Array = np.ndarray[Any, Any]
R = TypeVar("R")


class Deadline:
    """One absolute deadline for a whole call, whatever it sends and resends."""

    __slots__ = ("at", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self, what: str, details: str) -> DeadlineExceededError:
        why = f"{what} within {self.seconds:g} s"
        if details and details.lower() != "deadline exceeded":
            why += f" ({details})"
        return DeadlineExceededError(why)


class StreamReader(Protocol):
    def add(self, msg: Any) -> None: ...

    def finish(self) -> Any: ...


class TensorStreamReader:
    """A server stream: one header message naming the tensors, then their chunks."""

    def __init__(
        self,
        header: Callable[[Any], tuple[Any, list[pb.Tensor], list[str]]],
        *,
        encoded: bool = False,
        out: Sequence[Array] | None = None,
    ) -> None:
        self._header = header
        self._encoded = encoded
        self._out = out
        self._asm: TensorAssembler | None = None
        self._extra: Any = None

    def add(self, msg: Any) -> None:
        if self._asm is None:
            self._extra, tensors, names = self._header(msg)
            self._asm = TensorAssembler(
                tensors, names, encoded=self._encoded, out=self._out
            )
        else:
            self._asm.add(msg.chunk)

    def finish(self) -> tuple[Any, list[Array]]:
        if self._asm is None:
            raise TensorFormatError("the reply stream ended before its header")
        return self._extra, self._asm.finish()


@dataclass(frozen=True)
class Call:
    """One RPC: ``request()`` gives the message (or a fresh iterator of stream
    messages, for each send); ``reader`` is set when the reply is a stream;
    ``shard`` is the server of a cluster it goes to (None: the first, or the one
    server; ``on_shard`` sets it)."""

    method: str
    request: Callable[[], Any]
    deadline: Deadline
    what: str
    reader: Callable[[], StreamReader] | None = None
    shard: int | None = None

    def error(self, exc: grpc.RpcError) -> RpcError:
        """The one place a failed RPC becomes the client's exception."""
        error = translate(exc)
        if isinstance(error, DeadlineExceededError):
            return self.deadline.expired(self.what, error.details)
        if error.code == grpc.StatusCode.CANCELLED:
            # This client never cancels a call it waits on (a cancelled task raises
            # asyncio.CancelledError): the server did, because it is stopping (a
            # graceful stop cancels what it had not yet started).
            return UnavailableError(
                f"{self.what}: the server cancelled the call (it is stopping), so it "
                f"may or may not have taken effect ({error.details})",
                grpc.StatusCode.CANCELLED,
            )
        return error


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Parallel:
    """Run every operation at once; the reply is their results in order. Each one
    runs to its end; then the first failure (in order) is raised in the operation
    that asked. Cancelling the caller (an asyncio task) cancels every one."""

    ops: tuple[Generator[Any, Any, Any], ...]


@dataclass(frozen=True)
class Transfer:
    """A unary ``call`` whose tensor bytes travel on data ``channel``: while the
    call is in flight, the frame of ``send`` goes out, then (``receive``) the
    reply's frame comes in, into ``into`` where it fits. The reply is
    ``(message, frame)``. Any failure closes the channel; a failure the call does
    not explain raises ``ChannelBroken``. ``Client`` does the socket's part in the
    calling thread, ``AsyncClient`` in a worker thread."""

    call: Call
    channel: DataChannel
    transfer_id: int
    send: Sequence[Array] | None
    receive: bool
    into: Sequence[Array] | None = None
    widen: int = 0  # the reply's frame holds X in this encoding: widen into ``into``
    # ... or, without ``into``, into one new buffer of this dtype
    widen_dtype: np.dtype[Any] | None = None


@dataclass(frozen=True)
class Blocking:
    """A blocking step that is not an RPC (connecting a data channel's socket):
    the blocking ``Client`` runs ``fn`` in place, the ``AsyncClient`` in a worker
    thread, so the event loop never waits on it; ``cancel`` ends it there when
    the task waiting for it is cancelled (a frame call's socket is closed: the
    server ends the call as gRPC ends a cancelled one)."""

    fn: Callable[[], Any]
    cancel: Callable[[], None] | None = None


Effect = Call | Pause | Parallel | Transfer | Blocking


Op = Generator[Effect, Any, R]


def parallel(ops: Sequence[Op[R]]) -> Op[list[R]]:
    """The results of ``ops``, run at once (``Parallel``)."""
    if not ops:
        return []
    results: list[R] = yield Parallel(tuple(ops))
    return results


def on_shard(shard: int, op: Op[R]) -> Op[R]:
    """``op`` with its calls sent to ``shard`` of a cluster (calls that name a
    shard already keep theirs; the operations of a ``Parallel`` it yields name
    their own)."""
    reply: Any = None
    error: Exception | None = None
    while True:
        try:
            effect = op.send(reply) if error is None else op.throw(error)
        except StopIteration as stop:
            result: R = stop.value
            return result
        if isinstance(effect, Call) and effect.shard is None:
            effect = dataclasses.replace(effect, shard=shard)
        elif isinstance(effect, Transfer) and effect.call.shard is None:
            call = dataclasses.replace(effect.call, shard=shard)
            effect = dataclasses.replace(effect, call=call)
        reply, error = None, None
        try:
            reply = yield effect
        except GeneratorExit:
            op.close()
            raise
        except Exception as exc:  # the effect's failure, for ``op`` to handle
            error = exc


class OpRun:
    """Steps an operation: hands out its effects, feeds back their outcomes."""

    def __init__(self, op: Op[Any]) -> None:
        self._op = op
        self._reply: Any = None
        self._error: BaseException | None = None
        self.result: Any = None

    def next_effect(self) -> Effect | None:
        """The next effect to perform; None when the operation returned ``result``."""
        try:
            if self._error is not None:
                error, self._error = self._error, None
                return self._op.throw(error)
            return self._op.send(self._reply)
        except StopIteration as stop:
            self.result = stop.value
            return None

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, error: Exception) -> None:
        """The effect failed: ``error`` is raised in the operation."""
        self._error = error

    def abandon(self) -> None:
        """The runner stops before the end (a cancelled task): the operation is
        closed now, so it can note what it leaves undone (``_sharded.land``)."""
        self._op.close()


Int_co = TypeVar("Int_co", covariant=True)


Values_co = TypeVar("Values_co", covariant=True)


class PushCall(Protocol[Int_co, Values_co]):
    """The type of ``push`` on either client: T, or X_1..X_n with ``return_values``
    (``Client``: the values; ``AsyncClient``: coroutines of them). Written once
    here because overloads do not pass through the ParamSpec of the runners."""

    @overload
    def __call__(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = ...,
        learning_rate: float | None = ...,
        return_values: Literal[False] = ...,
        encoding: Encoding | None = ...,
        timeout: float | None = ...,
    ) -> Int_co: ...

    @overload
    def __call__(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = ...,
        learning_rate: float | None = ...,
        return_values: Literal[True],
        encoding: Encoding | None = ...,
        timeout: float | None = ...,
        out: Sequence[Any] | None = ...,
    ) -> Values_co: ...


def as_method(
    method: Callable[..., Any], op: Callable[..., Any], owner: str, name: str = ""
) -> None:
    """Name ``method``, which runs the operation ``op``, as ``owner``'s public call:
    ``help``, ``inspect.signature`` and the API reference show the operation's
    docstring and arguments with what the call returns (``method``'s own return
    annotation, its ``R`` the operation's result: ``Future[PushResult]``, not
    ``Op[PushResult]``)."""
    returns = method.__annotations__.get("return")
    module = method.__module__  # the client's, where the method is defined
    functools.update_wrapper(method, op)
    method.__module__ = module
    method.__name__ = name or op.__name__.removeprefix("_")
    method.__qualname__ = f"{owner}.{method.__name__}"
    signature = inspect.signature(op)  # push: push_detailed's arguments
    result = op.__annotations__.get("return", "")
    if isinstance(returns, str) and result.startswith("Op[") and result.endswith("]"):
        returns = re.sub(r"\bR\b", result[3:-1], returns)
        signature = signature.replace(return_annotation=returns)
    method.__signature__ = signature  # type: ignore[attr-defined]
    # The signature is the public one: tools that unwrap (griffe) read this method,
    # its docstring and this signature, not the operation's.
    del method.__wrapped__  # type: ignore[attr-defined]


def unary_request(msg: Any) -> Callable[[], Any]:
    return lambda: msg


def one_call(call: Call) -> Op[Any]:
    """An operation of one RPC: its reply."""
    return (yield call)


def unary_call(method: str, request: Any, deadline: Deadline) -> Op[Any]:
    """An operation of one unary RPC of ``request``: its reply."""
    return (yield Call(method, unary_request(request), deadline, what(method)))


def what(method: str) -> str:
    return f"{method} was not answered"
