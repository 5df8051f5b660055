"""The tensor RPCs: Push, PushStream, PushPullStream, Pull, PullStream, and the
hellos of the transports beside gRPC (SharedMemoryHello, DataChannelHello)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    ENCODING_NAMES,
    DeferredEncoding,
    EncodingRangeError,
    TensorAssembler,
    TensorFormatError,
    chunk_frames,
    declared_nbytes,
    encode_chunk,
    header_tensor,
    tensor_spec,
    tensor_to_array,
    write_tensor,
)

from ._datachannel import DataChannel, principal_of
from ._receive import Lease, Received, receive
from ._rpc import (
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
from .errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from .kernels._finite import finite_checker
from .limits import InflightHold
from .store import (
    PullResult,
    PushOutcome,
    PushTicket,
)

__all__ = ["TensorRpcs"]

log = logging.getLogger("onnxps.service")

Array = np.ndarray[Any, Any]

# The stream and unary RPCs answer with messages of the same fields.
R = TypeVar("R", pb.PushResponse, pb.PushStreamResponse)


T = TypeVar("T")


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


_END = object()


_REPLY_CHUNK_FIELD = pb.PushPullStreamResponse.DESCRIPTOR.fields_by_name["chunk"].number


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _leased(lease: Lease, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, then the gradient buffers of ``lease`` given back."""
    try:
        return fn(*args, **kwargs)
    finally:
        lease.release()


class _FrameSink:
    """Takes X from the store as a push steps it (a ``ValuesSink``) and hands it,
    as encoded PushPullStream frames, to the thread that sends the reply.

    The push runs on a thread of its own (``run``), so each block is copied into
    its frames under the group's lock and sent while the next block steps. After
    ``close`` (the caller went away) frames are dropped; the push still finishes.
    """

    def __init__(self, headers: Sequence[pb.Tensor], chunk_bytes: int) -> None:
        self._headers = headers
        self._chunk_bytes = chunk_bytes
        self._frames: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._views: list[memoryview] = []
        self._itemsizes: list[int] = []
        self._closed = False

    def begin(self, outcome: PushOutcome, xs: Sequence[Array]) -> None:
        self._views = [memoryview(x).cast("B") for x in xs]  # type: ignore[arg-type]
        self._itemsizes = [x.itemsize for x in xs]
        header = pb.PushResponse(
            update_count=outcome.update_count,
            applied=outcome.applied,
            duplicate=outcome.duplicate,
            values=self._headers,
        )
        self._put(pb.PushPullStreamResponse(header=header))

    def block(self, index: int, start: int, stop: int) -> None:
        size = self._itemsizes[index]
        view = self._views[index]
        step = self._chunk_bytes
        for a in range(start * size, stop * size, step):
            b = min(a + step, stop * size)
            self._put(encode_chunk(_REPLY_CHUNK_FIELD, index, a, view[a:b]))

    def _put(self, item: Any) -> None:
        if not self._closed:
            self._frames.put(item)

    def run(self, push: Callable[[], Any]) -> None:
        try:
            push()
        except BaseException as exc:  # noqa: BLE001 - raised on the sending thread
            self._frames.put(_Failed(exc))
        else:
            self._frames.put(_END)
        finally:
            self._views = []

    def frames(self) -> Iterator[Any]:
        while (item := self._frames.get()) is not _END:
            if isinstance(item, _Failed):
                error, item.error = item.error, None  # type: ignore[assignment]
                raise error
            yield item

    def close(self) -> None:
        self._closed = True


def _send_values(
    ch: DataChannel,
    tid: int,
    values: Sequence[Array],
    deadline: float | None,
    req: pb.PushRequest,
    out: PushOutcome,
) -> None:
    """X of a push already applied, on its channel. A failure to send it is the
    transport's (UNAVAILABLE, retried): the message says the push was applied, and
    a resend with the same seq is answered by exactly-once without a second step."""
    try:
        ch.send(tid, values, deadline)
    except (OSError, DeadlineExceeded) as exc:
        raise Unavailable(
            f"push seq {req.seq} to group {req.group!r} was applied (T="
            f"{out.update_count}) but its values could not be sent on the data "
            f"channel ({exc}); resend it with the same client_id and seq for them",
            reason="DATA_CHANNEL_BROKEN",
            metadata={"group": req.group, "update_count": out.update_count},
        ) from None


def _read_checked(
    ch: DataChannel,
    grads: list[Array],
    encodings: Sequence[int],
    context: Any,
    deadline: float | None,
) -> bool:
    """Receive a push's gradients from its frame into ``grads`` (widening the
    encoded ones), checking each block for NaN and inf as it lands; whether
    every element was finite."""
    flats = [g.reshape(-1) for g in grads]
    checked = [0] * len(grads)
    all_finite = finite_checker()
    finite = True

    def landed(i: int, elements: int) -> None:
        nonlocal finite
        if finite and elements > checked[i]:
            finite = all_finite(flats[i][checked[i] : elements])
            checked[i] = elements

    ch.read_into(grads, context.is_active, deadline, landed, encodings)
    return finite


class TensorRpcs(RpcFamily):
    """Push, PushStream, PushPullStream, Pull, PullStream, SharedMemoryHello,
    DataChannelHello."""

    def _push(
        self,
        req: pb.PushRequest,
        ticket: PushTicket,
        grads: list[Array],
        context: Any,
        reply_type: type[R],
        known_finite: bool = False,
    ) -> R:
        if req.HasField("reply_region"):  # refused before the step, not after
            self._shm.check(req.reply_region, caller_of(context), "reply_region")
        out = self._store_push(req, ticket, grads, context, known_finite)
        reply = reply_type(
            update_count=out.update_count, applied=out.applied, duplicate=out.duplicate
        )
        if out.values is None:
            return reply
        region = None
        if req.HasField("reply_region"):
            region = self._shm.write(req.reply_region, out.values, caller_of(context))
        if region is not None:
            reply.values_region.CopyFrom(region)
            reply.values.extend(map(header_tensor, out.values, ticket.names))
            return reply
        for v, n in zip(out.values, ticket.names, strict=True):
            write_tensor(reply.values.add(), v, n)
        return reply

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
            timeout=timeout_of(context),
            cancellation=cancellation_of(context) if req.return_values else None,
        )

    def _validate_push(self, req: pb.PushRequest) -> PushTicket:
        """Check the gradients' header against the group before reading any bytes."""
        specs = (
            tensor_spec(t, f"gradient {i + 1}", encoded=True)
            for i, t in enumerate(req.gradients)
        )
        return self.store.validate_push(req.group, specs)

    @unary
    def Push(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        if request.HasField("transfer"):
            return self._push_on_channel(request, context)
        ticket = self._validate_push(request)
        if request.HasField("gradients_region"):
            return self._push_shared(request, ticket, context)
        grads = [
            tensor_to_array(t, f"gradient {i + 1} ({ticket.names[i]!r})", encoded=True)
            for i, t in enumerate(request.gradients)
        ]
        return self._push(request, ticket, grads, context, pb.PushResponse)

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
        headers = list(req.gradients)
        names = names_of("gradient", len(headers), ticket.names)
        with self._gradient_buffers(ticket, headers) as lease:
            got = self._receive(it, headers, names, context, lease.arrays)
            return self._push(
                req, ticket, got.arrays, context, pb.PushStreamResponse, got.finite
            )

    def _gradient_buffers(
        self, ticket: PushTicket, headers: Sequence[pb.Tensor]
    ) -> Lease:
        try:
            specs = [tensor_spec(t, t.name, encoded=True) for t in headers]
            return self.gradient_pool.lease(ticket.group, specs)
        except (ValueError, OverflowError, MemoryError):
            return Lease([], None)  # the assembler says what is wrong with them

    def _receive(
        self,
        it: Iterator[Any],
        headers: Sequence[pb.Tensor],
        names: Sequence[str],
        context: Any,
        out: Sequence[Array],
    ) -> Received:
        """A push's gradients, into ``out`` where they fit; encoded ones widened."""
        asm = TensorAssembler(headers, names, encoded=True, out=out)
        try:
            return receive(it, asm)
        except TensorFormatError:
            raise_if_cut_off(context)
            raise

    def _push_shared(
        self, req: pb.PushRequest, ticket: PushTicket, context: Any
    ) -> pb.PushResponse:
        """A push whose gradients lie in the client's shared-memory segment: the
        store reads them in place."""
        specs = self._bare_specs(req, "in gradients_region")
        names = names_of("gradient", len(specs), ticket.names)
        caller = caller_of(context)
        with self._shm.read(req.gradients_region, specs, names, caller) as grads:
            return self._push(req, ticket, grads, context, pb.PushResponse)

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

    def _push_on_channel(self, req: pb.PushRequest, context: Any) -> pb.PushResponse:
        """A push whose gradients arrive as one frame on the data channel, each
        block checked for NaN and inf as it lands; X, when asked for, goes back as
        one frame."""
        with self._channel(req.transfer, context) as (ch, deadline):
            ticket = self._validate_push(req)
            specs = self._bare_specs(req, "on the data channel", encoded=True)
            codes = [t.encoding for t in req.gradients]
            counts = [int(np.prod(dims, dtype=np.int64)) for _, dims in specs]
            native = sum(
                n * d.itemsize for n, (d, _) in zip(counts, specs, strict=True)
            )
            # an encoded gradient travels in 2 bytes per element
            expected = sum(
                n * (2 if c else d.itemsize)
                for n, c, (d, _) in zip(counts, codes, specs, strict=True)
            )
            with self._reply_bytes(context, stream=False) as hold:
                hold.admit(
                    expected + (native if req.return_values else 0),
                    what="this push's gradients (and X) carry",
                )
                tid = req.transfer.transfer_id
                nbytes = ch.read_header(tid, context.is_active, deadline)
                if nbytes != expected:
                    raise InvalidArgument(
                        f"the data channel frame carries {nbytes} bytes; the "
                        f"gradients' headers declare {expected}",
                        reason="DATA_FRAME_SIZE",
                    )
                with self._gradient_buffers(ticket, list(req.gradients)) as lease:
                    grads = lease.arrays or [np.empty(d, t) for t, d in specs]
                    finite = _read_checked(ch, grads, codes, context, deadline)
                    out = self._store_push(req, ticket, grads, context, finite)
                # Applied: from here only the transport may fail, and says so.
                reply = pb.PushResponse(
                    update_count=out.update_count,
                    applied=out.applied,
                    duplicate=out.duplicate,
                )
                if out.values is not None:
                    reply.values.extend(map(header_tensor, out.values, ticket.names))
                    reply.values_on_channel = True
                    _send_values(ch, tid, out.values, deadline, req, out)
                return reply

    def _bare_specs(
        self, req: pb.PushRequest, where: str, *, encoded: bool = False
    ) -> list[tuple[np.dtype[Any], tuple[int, ...]]]:
        """The gradients' (dtype, dims) when their bytes travel apart from the
        message: no inline bytes, float only, and native unless ``encoded``."""
        specs = []
        for i, t in enumerate(req.gradients):
            if t.raw_data:
                raise InvalidArgument(
                    f"gradient {i + 1} carries bytes inline and {where}: with a "
                    "region or a transfer, raw_data must be empty",
                    field=f"gradients[{i}].raw_data",
                )
            if t.encoding and not encoded:
                raise InvalidArgument(
                    f"gradient {i + 1} is encoded: gradients {where} travel in the "
                    "group's dtype (float32 or float64); encoded gradients go on the "
                    "data channel or over gRPC",
                    field=f"gradients[{i}].encoding",
                )
            dtype, dims = tensor_spec(t, f"gradient {i + 1}", encoded=encoded)
            if dtype.kind != "f":
                raise InvalidArgument(
                    f"gradient {i + 1} is {dtype}: gradients {where} travel in the "
                    "group's dtype (float32 or float64)",
                    field=f"gradients[{i}].dtype",
                )
            specs.append((dtype, tuple(dims)))
        return specs

    @unary
    def DataChannelHello(
        self, request: pb.DataChannelHelloRequest, context: Any
    ) -> pb.DataChannelHelloResponse:
        if self._data is None:
            raise FailedPrecondition(
                "this server serves no data channel (start it with --data-port)",
                reason="DATA_CHANNEL_OFF",
            )
        port, ticket, seconds = self._data.hello(
            principal_of(context.invocation_metadata())
        )
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
            lease = self._gradient_buffers(ticket, headers)
            try:
                got = self._receive(
                    it, headers, names_of("gradient", len(headers), ticket.names),
                    context, lease.arrays,
                )  # fmt: skip
            except BaseException:
                lease.release()
                raise
            values = [
                pb.Tensor(name=n, dtype=t.dtype, dims=t.dims)
                for n, t in zip(ticket.names, headers, strict=True)
            ]
            sink = _FrameSink(values, self.chunk_bytes)
            push = functools.partial(
                _leased,
                lease,
                self.store.push,
                ticket,
                got.arrays,
                known_finite=got.finite,
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
            del got
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
            for a, n in zip(arrays, out.names, strict=True):
                write_tensor(reply.tensors.add(), a, n)
            return reply

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
