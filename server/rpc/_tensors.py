"""The tensor RPCs: Push, PushStream, PushPullStream, Pull, PullStream, and the
hellos of the transports beside gRPC (SharedMemoryHello, DataChannelHello)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    ENCODING_NAMES,
    DeferredEncoding,
    EncodedMessage,
    EncodingRangeError,
    chunk_frames,
    declared_nbytes,
    header_tensor,
    tensor_spec,
)

from ..errors import FailedPrecondition, InvalidArgument, Unavailable
from ..interceptors.limits import InflightHold
from ..store import PullResult, PushOutcome, PushTicket
from ..transports._datachannel import DataChannel, principal_of
from ..transports._shm import Caller
from ._common import (
    RpcFamily,
    caller_of,
    cancellation_of,
    names_of,
    raise_if_cut_off,
    stream_header,
    streaming,
    timeout_of,
    unary,
)
from ._transports import (
    ChannelGradients,
    ChannelValues,
    FrameSink,
    GradientSource,
    InlineGradients,
    InlineValues,
    RegionGradients,
    RegionValues,
    StreamGradients,
    ValuesSink,
    bare_specs,
    channel_frame_bytes,
    pooled,
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


def _encoded_values(
    arrays: Sequence[Array], names: Sequence[str], encoding: int
) -> Sequence[Array]:
    """X in the pull's encoding (checked by ``_check_pull_encoding``), encoded
    whole now."""
    try:
        return [
            a.encoded() if isinstance(a, DeferredEncoding) else a
            for a in _deferred_values(arrays, names, encoding)
        ]
    except EncodingRangeError as exc:
        raise _out_of_range(exc, encoding) from None


def _deferred_values(
    arrays: Sequence[Array], names: Sequence[str], encoding: int
) -> Sequence[Array | DeferredEncoding]:
    """X in the pull's encoding, encoded block by block as the data channel
    sends it."""
    if not encoding:
        return arrays
    name = ENCODING_NAMES[encoding]
    return [
        DeferredEncoding(a, name, f"X {n!r}")
        for a, n in zip(arrays, names, strict=True)
    ]


def _out_of_range(exc: EncodingRangeError, encoding: int) -> FailedPrecondition:
    name = ENCODING_NAMES[encoding]
    return FailedPrecondition(
        f"cannot pull as {name}: {exc}",
        reason="OUT_OF_ENCODING_RANGE",
        metadata={"encoding": name},
    )


class TensorRpcs(RpcFamily):
    """Push, PushStream, PushPullStream, Pull, PullStream, SharedMemoryHello,
    DataChannelHello."""

    def _store_push(
        self,
        req: pb.PushRequest,
        ticket: PushTicket,
        grads: list[Array],
        context: Any,
        known_finite: bool,
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
        )

    def _validate_push(self, req: pb.PushRequest) -> PushTicket:
        """Check the gradients' header against the group before reading any bytes."""
        specs = (
            tensor_spec(t, f"gradient {i + 1}", encoded=True)
            for i, t in enumerate(req.gradients)
        )
        return self.store.validate_push(req.group, specs)

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
            out = self._store_push(req, ticket, grads, context, finite)
        # Applied: from here only the transport may fail, and says so.
        reply = reply_type(
            update_count=out.update_count, applied=out.applied, duplicate=out.duplicate
        )
        if out.values is not None:
            sink.send(reply, out.values, ticket.names)
        return reply

    def _values_sink(
        self, req: pb.PushRequest, context: Any, caller: Caller | None = None
    ) -> ValuesSink:
        """Where a push's X goes: the client's reply segment, or the reply."""
        if req.HasField("reply_region"):
            caller = caller or caller_of(context)
            return RegionValues(self._shm, req.reply_region, caller)
        return InlineValues()

    @unary
    def Push(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        if request.HasField("transfer"):
            return self._push_on_channel(request, context)
        ticket = self._validate_push(request)
        source: GradientSource = InlineGradients(request, ticket)
        caller = None
        if request.HasField("gradients_region"):
            names = names_of("gradient", len(request.gradients), ticket.names)
            caller = caller_of(context)
            source = RegionGradients(self._shm, request, ticket, caller, names)
        sink = self._values_sink(request, context, caller)
        return self._step(request, ticket, source, sink, context, pb.PushResponse)

    @unary
    def PushStream(
        self, request_iterator: Iterable[pb.PushStreamRequest], context: Any
    ) -> pb.PushStreamResponse:
        req, it = stream_header(request_iterator, "header", "a PushStream", context)
        if req.HasField("gradients_region"):
            raise InvalidArgument(
                "a PushStream carries its gradients as chunks; gradients in shared "
                "memory (gradients_region) go in a unary Push",
                field="header.gradients_region",
            )
        ticket = self._validate_push(req)
        source = self._stream_gradients(req, ticket, it, context)
        sink = self._values_sink(req, context)
        return self._step(req, ticket, source, sink, context, pb.PushStreamResponse)

    def _stream_gradients(
        self, req: pb.PushRequest, ticket: PushTicket, it: Iterator[Any], context: Any
    ) -> StreamGradients:
        headers = list(req.gradients)
        names = names_of("gradient", len(headers), ticket.names)
        lease = pooled(self.gradient_pool, ticket.group, headers)
        return StreamGradients(
            it, headers, names, lease, lambda: raise_if_cut_off(context)
        )

    def _push_on_channel(self, req: pb.PushRequest, context: Any) -> pb.PushResponse:
        """A push whose gradients arrive as one frame on the data channel, each
        block checked for NaN and inf as it lands; X, when asked for, goes back as
        one frame."""
        with self._channel(req.transfer, context) as (ch, deadline):
            ticket = self._validate_push(req)
            specs = bare_specs(req, "on the data channel", encoded=True)
            codes = [t.encoding for t in req.gradients]
            framed, native = channel_frame_bytes(specs, codes)
            with self._reply_bytes(context, stream=False) as hold:
                hold.admit(
                    framed + (native if req.return_values else 0),
                    what="this push's gradients (and X) carry",
                )
                lease = pooled(self.gradient_pool, ticket.group, list(req.gradients))
                source = ChannelGradients(
                    ch, req, specs, lease, context.is_active, deadline
                )
                sink = ChannelValues(ch, req, deadline)
                return self._step(req, ticket, source, sink, context, pb.PushResponse)

    @contextmanager
    def _channel(
        self, transfer: pb.DataTransfer, context: Any
    ) -> Iterator[tuple[DataChannel, float | None]]:
        """The call's data channel (closed if the call fails) and its deadline."""
        if self._data is None:
            raise FailedPrecondition(
                "this server serves no data channel (start it with --data-port)",
                reason="DATA_CHANNEL_OFF",
            )
        timeout = timeout_of(context)
        deadline = None if timeout is None else time.monotonic() + timeout
        principal = principal_of(context.invocation_metadata())
        with self._data.use(transfer.channel, principal, transfer.transfer_id) as ch:
            yield ch, deadline

    @unary
    def DataChannelHello(
        self, request: pb.DataChannelHelloRequest, context: Any
    ) -> pb.DataChannelHelloResponse:
        if self._data is None:
            raise FailedPrecondition(
                "this server serves no data channel (start it with --data-port)",
                reason="DATA_CHANNEL_OFF",
            )
        metadata = context.invocation_metadata()
        port, ticket, seconds = self._data.hello(principal_of(metadata), metadata)
        return pb.DataChannelHelloResponse(
            port=port, ticket=ticket, ticket_seconds=seconds
        )

    @unary
    def SharedMemoryHello(
        self, request: pb.SharedMemoryHelloRequest, context: Any
    ) -> pb.SharedMemoryHelloResponse:
        nonce = self._shm.hello(request.segment, request.key, caller_of(context))
        return pb.SharedMemoryHelloResponse(nonce=nonce)

    @streaming
    def PushPullStream(
        self, request_iterator: Iterable[pb.PushPullStreamRequest], context: Any
    ) -> Iterator[Any]:
        req, it = stream_header(request_iterator, "header", "a PushPullStream", context)
        if req.HasField("gradients_region") or req.HasField("reply_region"):
            raise InvalidArgument(
                "a PushPullStream carries tensors as chunks; tensors in shared memory "
                "go in a unary Push",
                field="header.gradients_region",
            )
        ticket = self._validate_push(req)
        headers = list(req.gradients)
        with self._reply_bytes(context, stream=True) as hold:
            hold.admit(
                sum(declared_nbytes(t) for t in headers),
                what="this push's reply carries",
            )
            source = self._stream_gradients(req, ticket, it, context)
            lease = source.lease
            try:
                grads, finite = source.receive()
            except BaseException:
                lease.release()
                raise
            values = [
                pb.Tensor(name=n, dtype=t.dtype, dims=t.dims)
                for n, t in zip(ticket.names, headers, strict=True)
            ]
            # X is copied into the gradient buffers as their elements are spent
            # (``FrameSink``), which go back once the reply is sent
            sink = FrameSink(values, self.chunk_bytes, grads, lease.release)
            push = functools.partial(
                self.store.push,
                ticket,
                grads,
                known_finite=finite,
                client_id=req.client_id,
                seq=req.seq,
                base_version=req.base_version if req.HasField("base_version") else None,
                learning_rate=req.learning_rate
                if req.HasField("learning_rate")
                else None,
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

    def _pull(
        self,
        req: pb.PullRequest | pb.PullStreamRequest,
        context: Any,
        hold: InflightHold,
    ) -> PullResult:
        waits = req.HasField("min_version")
        _check_pull_encoding(req)
        return self.store.pull(
            req.group,
            with_state=req.with_state,
            min_version=req.min_version if waits else None,
            timeout=timeout_of(context),
            cancellation=cancellation_of(context) if waits else None,
            reserve=functools.partial(hold.admit, what="this pull's reply carries"),
        )

    def _pull_shared(self, req: pb.PullRequest, context: Any) -> pb.PullResponse | None:
        """A pull written straight from the group into the client's segment (one
        copy, under the group's lock); None when it does not fit there."""

        caller = caller_of(context)
        self._shm.check(req.reply_region, caller, "reply_region")  # before the lock

        def write(arrays: Sequence[Array], names: tuple[str, ...]) -> pb.PullResponse:
            region = self._shm.write(req.reply_region, arrays, caller)
            reply = pb.PullResponse()
            if region is not None:
                reply.tensors_region.CopyFrom(region)
                reply.tensors.extend(map(header_tensor, arrays, names))
            return reply

        waits = req.HasField("min_version")
        t, lr, reply = self.store.pull_into(
            req.group,
            write,
            with_state=req.with_state,
            min_version=req.min_version if waits else None,
            timeout=timeout_of(context),
            cancellation=cancellation_of(context) if waits else None,
        )
        if not reply.HasField("tensors_region"):
            return None
        reply.update_count, reply.learning_rate = t, lr
        return reply

    @unary
    def Pull(self, request: pb.PullRequest, context: Any) -> pb.PullResponse:
        if request.HasField("transfer"):
            return self._pull_on_channel(request, context)
        if request.HasField("reply_region"):
            shared = self._pull_shared(request, context)
            if shared is not None:
                return shared
        with self._reply_bytes(context, stream=False) as hold:
            out = self._pull(request, context, hold)
            reply = pb.PullResponse(
                update_count=out.update_count, learning_rate=out.learning_rate
            )
            arrays = _encoded_values(out.arrays, out.names, request.encoding)
            # joined when sent over gRPC; a frame call sends the arrays' bytes
            return EncodedMessage(  # type: ignore[return-value]
                reply, "tensors", arrays, out.names, defer=True
            )

    def _pull_on_channel(self, req: pb.PullRequest, context: Any) -> pb.PullResponse:
        """A pull whose tensors go back as one frame on the data channel (X in
        the pull's encoding, when it asks for one)."""
        with self._channel(req.transfer, context) as (ch, deadline):
            with self._reply_bytes(context, stream=False) as hold:
                out = self._pull(req, context, hold)
                arrays = _deferred_values(out.arrays, out.names, req.encoding)
                try:
                    ch.send(req.transfer.transfer_id, arrays, deadline)
                except EncodingRangeError as exc:  # mid-frame: the channel closes
                    raise _out_of_range(exc, req.encoding) from None
                except OSError as exc:
                    raise Unavailable(
                        f"the pull's tensors could not be sent on the data channel "
                        f"({exc}); pull again",
                        reason="DATA_CHANNEL_BROKEN",
                    ) from None
                return pb.PullResponse(
                    update_count=out.update_count,
                    learning_rate=out.learning_rate,
                    tensors=[
                        header_tensor(a, n)
                        for a, n in zip(arrays, out.names, strict=True)
                    ],
                    tensors_on_channel=True,
                )

    @streaming
    def PullStream(self, request: pb.PullStreamRequest, context: Any) -> Iterator[Any]:
        with self._reply_bytes(context, stream=True) as hold:
            out = self._pull(request, context, hold)
            arrays = _encoded_values(out.arrays, out.names, request.encoding)
            header = pb.PullResponse(
                update_count=out.update_count,
                learning_rate=out.learning_rate,
                tensors=[
                    header_tensor(a, n) for a, n in zip(arrays, out.names, strict=True)
                ],
            )
            yield pb.PullStreamResponse(header=header)
            yield from chunk_frames(pb.PullStreamResponse, arrays, self.chunk_bytes)
