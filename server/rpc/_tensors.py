"""The tensor RPCs: Push, PushStream, PushPullStream, Pull, PullStream, and the
hellos of the transports beside gRPC (SharedMemoryHello, DataChannelHello)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import ENCODING_NAMES

from ..errors import InvalidArgument
from ..store import PullResult, PushOutcome, PushTicket
from ..store import ValuesSink as StoreSink
from ..transports._datachannel import principal_of
from ._common import (
    RpcFamily,
    caller_of,
    cancellation_of,
    stream_header,
    streaming,
    timeout_of,
    unary,
)
from ._transports import (
    FrameSink,
    GradientSource,
    StreamGradients,
    Transports,
    ValuesSink,
)

__all__ = ["TensorRpcs"]

log = logging.getLogger("onnxps.service")

Array = np.ndarray[Any, Any]

# The stream and unary RPCs answer with messages of the same fields.
R = TypeVar("R", pb.PushResponse, pb.PushStreamResponse)


def _check_pull_encoding(req: pb.PullRequest | pb.PullStreamRequest) -> None:
    """A pull's encoding: a known one, and for X alone (state travels native)."""
    if not req.encoding:
        return
    name = ENCODING_NAMES.get(req.encoding)
    if name is None:
        raise InvalidArgument(
            f"encoding {req.encoding} is not one of ENCODING_UNSPECIFIED (0, native), "
            "ENCODING_BFLOAT16 (1) or ENCODING_FLOAT16 (2)",
            field="encoding",
        )
    if req.with_state:
        raise InvalidArgument(
            f"a pull with_state travels native: the {name} encoding is for X alone "
            "(pull X encoded, or the state without an encoding)",
            field="encoding",
        )


class _Pulled:
    """A pull's values from the store (``Pulled``, what a ``PullSink`` asks for)."""

    __slots__ = ("store", "req", "context")

    def __init__(
        self, store: Any, req: pb.PullRequest | pb.PullStreamRequest, context: Any
    ) -> None:
        self.store = store
        self.req = req
        self.context = context

    def values(self, reserve: Callable[[int], None]) -> PullResult:
        req, context = self.req, self.context
        waits = req.HasField("min_version")
        _check_pull_encoding(req)
        return self.store.pull(  # type: ignore[no-any-return]
            req.group,
            with_state=req.with_state,
            min_version=req.min_version if waits else None,
            timeout=timeout_of(context),
            cancellation=cancellation_of(context) if waits else None,
            reserve=reserve,
        )

    def into(
        self, write: Callable[[Sequence[Array], tuple[str, ...]], pb.PullResponse]
    ) -> tuple[int, float, pb.PullResponse]:
        req, context = self.req, self.context
        waits = req.HasField("min_version")
        return self.store.pull_into(  # type: ignore[no-any-return]
            req.group,
            write,
            with_state=req.with_state,
            min_version=req.min_version if waits else None,
            timeout=timeout_of(context),
            cancellation=cancellation_of(context) if waits else None,
        )


class TensorRpcs(RpcFamily):
    """Push, PushStream, PushPullStream, Pull, PullStream, SharedMemoryHello,
    DataChannelHello: each asks the transport seam (``self.transports``) where its
    tensors come from and go, and runs one routine over them (``_step``,
    ``_step_streamed``, ``_pull``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Which way a call's tensors travel (the one place that reads it).
        self.transports = Transports(
            validate=self.store.validate_push,
            reply_bytes=self._reply_bytes,
            shared_memory=self._shm,
            data_channels=self._data,
            gradient_pool=self.gradient_pool,
            chunk_bytes=self.chunk_bytes,
        )

    def _store_push(
        self,
        req: pb.PushRequest,
        ticket: PushTicket,
        grads: list[Array],
        context: Any,
        known_finite: bool,
        sink: StoreSink | None = None,
        spent: bool = False,
    ) -> PushOutcome:
        return self.store.push(
            ticket,
            grads,
            known_finite=known_finite,
            client_id=req.client_id,
            seq=req.seq,
            base_version=req.base_version if req.HasField("base_version") else None,
            learning_rate=req.learning_rate if req.HasField("learning_rate") else None,
            return_values=req.return_values,
            # only a push returning X may wait (for its sync step)
            timeout=timeout_of(context) if req.return_values else None,
            cancellation=cancellation_of(context) if req.return_values else None,
            sink=sink if req.return_values else None,
            spent=spent,
        )

    def _step(
        self,
        req: pb.PushRequest,
        ticket: PushTicket,
        source: GradientSource,
        sink: ValuesSink,
        context: Any,
        reply_type: type[R],
    ) -> R:
        """One push over its transports: the gradients from ``source``, the step,
        X to ``sink`` (checked before the step: a reply it cannot send refuses the
        push before it applies)."""
        with source.gradients() as (grads, finite):
            sink.check()
            emitter = sink.emitter(ticket) if req.return_values else None
            # gradients a resend's first answer wrote X over (shared memory)
            spent = bool(getattr(source, "spent", False))
            out = self._store_push(req, ticket, grads, context, finite, emitter, spent)
        # Applied: from here only the transport may fail, and says so.
        reply = reply_type(
            update_count=out.update_count, applied=out.applied, duplicate=out.duplicate
        )
        if out.values is not None or emitter is not None:
            sink.send(reply, out.values, ticket.names)
        return reply

    def _step_streamed(
        self,
        req: pb.PushRequest,
        ticket: PushTicket,
        source: StreamGradients,
        sink: FrameSink,
        context: Any,
    ) -> Iterator[Any]:
        """One push whose X goes out while it steps: the gradients received, the
        step on a thread of its own, X's frames sent from here as they come."""
        lease = source.lease
        try:
            grads, finite = source.receive()
        except BaseException:
            lease.release()
            raise
        # X is copied into the gradient buffers as their elements are spent
        # (``FrameSink``), which go back once the reply is sent
        sink.lend(grads, lease.release)
        push = functools.partial(
            self.store.push,
            ticket,
            grads,
            known_finite=finite,
            client_id=req.client_id,
            seq=req.seq,
            base_version=req.base_version if req.HasField("base_version") else None,
            learning_rate=req.learning_rate if req.HasField("learning_rate") else None,
            return_values=True,
            timeout=timeout_of(context),
            cancellation=cancellation_of(context),
            sink=sink,
        )
        del grads
        worker = threading.Thread(
            target=sink.run, args=(push,), name="onnxps-push", daemon=True
        )
        try:
            worker.start()
        except BaseException:
            lease.release()
            raise
        try:
            yield from sink.frames()
        finally:
            sink.close()

    @unary
    def Push(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        with self.transports.push(request, context) as (ticket, source, sink):
            return self._step(request, ticket, source, sink, context, pb.PushResponse)

    @unary
    def PushStream(
        self, request_iterator: Iterable[pb.PushStreamRequest], context: Any
    ) -> pb.PushStreamResponse:
        req, it = stream_header(request_iterator, "header", "a PushStream", context)
        with self.transports.push(req, context, it) as (ticket, source, sink):
            return self._step(req, ticket, source, sink, context, pb.PushStreamResponse)

    @streaming
    def PushPullStream(
        self, request_iterator: Iterable[pb.PushPullStreamRequest], context: Any
    ) -> Iterator[Any]:
        req, it = stream_header(request_iterator, "header", "a PushPullStream", context)
        with self.transports.push_pull(req, it, context) as (ticket, source, sink):
            yield from self._step_streamed(req, ticket, source, sink, context)

    @unary
    def Pull(self, request: pb.PullRequest, context: Any) -> pb.PullResponse:
        return self._pull(request, context)  # type: ignore[no-any-return]

    @streaming
    def PullStream(self, request: pb.PullStreamRequest, context: Any) -> Iterator[Any]:
        yield from self._pull(request, context)

    def _pull(self, req: pb.PullRequest | pb.PullStreamRequest, context: Any) -> Any:
        """One pull: its values from the store, sent the way the seam says."""
        sink = self.transports.pull(req, context)
        return sink.reply(_Pulled(self.store, req, context))

    @unary
    def DataChannelHello(
        self, request: pb.DataChannelHelloRequest, context: Any
    ) -> pb.DataChannelHelloResponse:
        data = self.transports.data_channels()
        metadata = context.invocation_metadata()
        port, ticket, seconds = data.hello(principal_of(metadata), metadata)
        return pb.DataChannelHelloResponse(
            port=port, ticket=ticket, ticket_seconds=seconds
        )

    @unary
    def SharedMemoryHello(
        self, request: pb.SharedMemoryHelloRequest, context: Any
    ) -> pb.SharedMemoryHelloResponse:
        shm = self.transports.shared_memory()
        nonce = shm.hello(request.segment, request.key, caller_of(context))
        return pb.SharedMemoryHelloResponse(nonce=nonce)
