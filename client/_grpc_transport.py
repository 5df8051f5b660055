"""Tensor bytes inside gRPC messages: inline in one unary message, or chunked on a
stream (``TensorTransport``, see ``_transport``), and the push's resend loop every
transport shares."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    EncodedMessage,
    chunk_frames,
    header_tensors,
)
from onnxps.wire.encoding import DeferredEncoding
from onnxps.wire.replies import tensor_arrays

from ._errors import DeadlineExceededError, RpcError, UnavailableError
from ._ops import Call, Deadline, Op, Pause, one_call, unary_request
from ._records import PushResult
from ._replies import inline_values, pull_reader, push_reader

__all__ = [
    "GrpcHost",
    "InlineTransport",
    "StreamTransport",
    "Transport",
    "chunk_stream",
    "pull_waited",
    "resending",
]

log = logging.getLogger("onnxps.client")

Array = np.ndarray[Any, Any]
Transport = Literal["auto", "unary", "stream"]

_RESEND_BACKOFF_MAX = 2.0  # seconds between a push's resends, at most
_RESEND_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class GrpcHost(Protocol):
    """What the gRPC transports read from their client, live (a client's
    ``transport`` may be changed between calls)."""

    address: str
    transport: Transport
    stream_threshold_bytes: int
    chunk_bytes: int


def chunk_stream(
    message: Any, header: Any, arrays: Sequence[Array], chunk_bytes: int
) -> Callable[[], Iterator[Any]]:
    """A client stream: the header, then every array in chunks."""
    field = "request" if message is pb.ApplyStreamRequest else "header"

    def chunks() -> Iterator[Any]:
        yield message(**{field: header})
        yield from chunk_frames(message, arrays, chunk_bytes)

    return chunks


def pull_waited(request: pb.PullRequest) -> str:
    """What a pull that timed out was waiting for."""
    if request.HasField("min_version"):
        return f"group {request.group} did not reach T={request.min_version}"
    return f"the pull of group {request.group} was not answered"


def pushed_what(request: pb.PushRequest) -> str:
    return f"the push to group {request.group} (seq {request.seq}) was not answered"


_RESEND_LOG_EVERY = 5.0  # seconds between the warnings of one push's resends


def resending(
    call: Call,
    group: str,
    seq: int,
    address: str,
    send: Callable[[Call], Op[Any]] = one_call,
) -> Op[Any]:
    """Send a push (``send``: as one RPC, or as a frame first), and resend it
    (same seq) while the server is unavailable, until the deadline: the server
    answers a repeat with its first result. The first resend is a WARNING that
    says why and how to wait less; the next ones warn again at most every
    ``_RESEND_LOG_EVERY`` seconds."""
    backoff = 0.1
    unavailable: RpcError | None = None
    warned_at: float | None = None
    while True:
        try:
            return (yield from send(call))
        except DeadlineExceededError:
            if unavailable is None:
                raise
            raise _gone(address, group, seq, call.deadline, unavailable) from None
        except RpcError as exc:
            if exc.code not in _RESEND_CODES:
                raise
            unavailable = exc
        pause = min(backoff, call.deadline.remaining())
        if pause <= 0:
            raise _gone(address, group, seq, call.deadline, unavailable)
        warned_at = _warn_resending(call, group, address, unavailable, warned_at)
        log.info(
            "push to %s seq %d: %s; resending in %.1f s",
            group,
            seq,
            unavailable.code.name,
            pause,
        )
        yield Pause(pause)
        backoff = min(_RESEND_BACKOFF_MAX, backoff * 2)


def _warn_resending(
    call: Call, group: str, address: str, last: RpcError, warned_at: float | None
) -> float | None:
    """Log that a push is being resent (at most every ``_RESEND_LOG_EVERY`` s);
    the time of the last warning."""
    deadline = call.deadline
    now = deadline.seconds - deadline.remaining()  # seconds since the call began
    if warned_at is not None and now - warned_at < _RESEND_LOG_EVERY:
        return warned_at
    log.warning(
        "push to group %s: the server at %s is unavailable (%s: %s); resending "
        "until the call's deadline, %.0f s from now (timeout=%g; pass a smaller "
        "timeout= to the client or the push to give up sooner)",
        group,
        address,
        last.code.name,
        last.details,
        deadline.remaining(),
        deadline.seconds,
    )
    return now


def _gone(
    address: str, group: str, seq: int, deadline: Deadline, last: RpcError
) -> UnavailableError:
    return UnavailableError(
        f"the server at {address} stayed unavailable for "
        f"{deadline.seconds:g} s ({last.details}); the push to group "
        f"{group} (seq {seq}) may not have been applied",
        reason=last.reason,  # the last refusal's details (e.g. WAL_WRITE_FAILED)
        metadata=last.metadata,
        violations=last.violations,
    )


def _native(arrays: Sequence[Any]) -> list[Array]:
    """The arrays to send as bytes (a deferred encoding encoded now, whole)."""
    return [a.encoded() if isinstance(a, DeferredEncoding) else a for a in arrays]


def _copy(template: pb.PushRequest) -> pb.PushRequest:
    req = pb.PushRequest()
    req.CopyFrom(template)
    return req


class InlineTransport:
    """Tensor bytes inside one unary message each way (``send``: how its one
    call goes, an RPC here; as a frame first in ``FrameTransport``)."""

    def __init__(self, host: GrpcHost) -> None:
        self.host = host

    def send(self, call: Call) -> Op[Any]:
        return (yield call)

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        req = _copy(template)
        # the gradients are read when sent, from where they are by a frame (joined
        # by gRPC's serializer): the caller waits for the push meanwhile (a flat
        # push's one array is its form's own, ``push_background`` copied its)
        msg = EncodedMessage(req, "gradients", _native(arrays), defer=True)
        call = Call("Push", lambda: msg, deadline, pushed_what(req))
        address = self.host.address
        got = yield from resending(call, req.group, req.seq, address, self.send)
        values = inline_values(got, out) if req.return_values else None
        return PushResult(got.update_count, got.applied, got.duplicate, values)

    def pull(
        self, request: pb.PullRequest, deadline: Deadline, out: Sequence[Array] | None
    ) -> Op[tuple[int, list[Array]]]:
        call = Call("Pull", lambda: request, deadline, pull_waited(request))
        msg = yield from self.send(call)
        return msg.update_count, tensor_arrays(msg, "tensors", encoded=True)


class StreamTransport:
    """Tensor bytes in ~1 MiB chunks on a gRPC stream; a push that returns X is a
    PushPullStream (X comes back in chunks, sent while the server steps)."""

    def __init__(self, host: GrpcHost) -> None:
        self.host = host

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        req = _copy(template)
        native = _native(arrays)
        req.gradients.extend(header_tensors(native))
        what = pushed_what(req)
        step = self.host.chunk_bytes
        address = self.host.address
        if req.return_values:
            chunks = chunk_stream(pb.PushPullStreamRequest, req, native, step)
            reader = functools.partial(push_reader, out)
            call = Call("PushPullStream", chunks, deadline, what, reader)
            msg, values = yield from resending(call, req.group, req.seq, address)
            return PushResult(msg.update_count, msg.applied, msg.duplicate, values)
        chunks = chunk_stream(pb.PushStreamRequest, req, native, step)
        call = Call("PushStream", chunks, deadline, what)
        msg = yield from resending(call, req.group, req.seq, address)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, None)

    def pull(
        self, request: pb.PullRequest, deadline: Deadline, out: Sequence[Array] | None
    ) -> Op[tuple[int, list[Array]]]:
        req = pb.PullStreamRequest(
            group=request.group,
            with_state=request.with_state,
            encoding=request.encoding,
            layout=request.layout,
        )
        if request.HasField("min_version"):
            req.min_version = request.min_version
        reader = functools.partial(pull_reader, out)
        waited = pull_waited(request)
        t, arrays = yield Call(
            "PullStream", unary_request(req), deadline, waited, reader
        )
        return int(t), arrays
