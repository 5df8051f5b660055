"""The gRPC servicer: a thin adapter over ``ParameterStore``.

Each RPC decodes its request, calls the store (or the kernels, for Apply), encodes
the reply, and maps domain errors to a status with details (``_status.status_of``).

A caller that goes away (it cancels, or its deadline passes) is not a server error:
the call ends quietly (DEBUG), and what it held is dropped at once, its traceback's
frames too (grpc keeps the ``RpcError`` it raised into the servicer, so frames left on
it would keep a half-received push alive until the cycle collector runs). A call
that waits for a version learns through a ``Cancellation`` that its caller left.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import (
    CHUNK_BYTES,
    ENCODING_NAMES,
    PROTO_TO_DTYPE,
    DeferredEncoding,
    EncodingRangeError,
    TensorAssembler,
    TensorFormatError,
    chunk_frames,
    declared_nbytes,
    deserializer,
    encode_chunk,
    header_tensor,
    rpc_messages,
    serializer,
    tensor_spec,
    tensor_to_array,
    write_tensor,
)

from ._convert import (
    attrs_from_proto,
    consistency_from_proto,
    group_info,
    table_from_proto,
)
from ._datachannel import DataChannel, DataChannels, principal_of
from ._receive import GradientPool, Lease, Received, receive
from ._shm import Caller, SharedMemory
from ._status import rich_status, status_of
from .durability import SaveResult
from .errors import FailedPrecondition, InvalidArgument
from .kernels import apply_onnx
from .kernels._finite import finite_checker
from .limits import InflightBytes, InflightHold
from .store import (
    CallCancelled,
    Cancellation,
    LeaseView,
    ParameterStore,
    PullResult,
    PushOutcome,
    PushTicket,
)

__all__ = ["ParameterServerServicer", "add_servicer"]

log = logging.getLogger("onnxps.service")

Array = np.ndarray[Any, Any]
F = TypeVar("F", bound=Callable[..., Any])
# The Replicate stream's handler (onnxps.server.replication): requests in, replies out.
Replicate = Callable[
    [Iterable[pb.ReplicateRequest], Any], Iterator[pb.ReplicateResponse]
]
# A wait ends this much before its call's deadline (at most a tenth of the time left).
_ANSWER_EARLY_SECONDS = 0.05
# How long a request stream that ended early is watched for its client's cancellation.
_CUT_OFF_SECONDS = 0.2
# The stream and unary RPCs answer with messages of the same fields.
R = TypeVar("R", pb.PushResponse, pb.PushStreamResponse)
T = TypeVar("T")
L = TypeVar("L", pb.JoinGroupResponse, pb.HeartbeatResponse, pb.LeaveGroupResponse)


def _failure(
    exc: BaseException, context: grpc.ServicerContext, method: str
) -> grpc.Status:
    """The status an exception ends a call with (logged when it is a bug)."""
    kept = tuple(context.trailing_metadata() or ())  # e.g. the request id echo
    if isinstance(exc, (grpc.RpcError, CallCancelled)) or not context.is_active():
        _drop_frames(exc)
        log.debug("%s: the client went away (cancelled or out of time)", method)
        code = grpc.StatusCode.CANCELLED
        gone = "the client cancelled the call"
        return rich_status(code, gone, code.name, trailers=kept)
    status = status_of(exc, kept)
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


def _unary(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            if _already_aborted(context):
                raise
            status = _failure(exc, context, method.__name__)
        # Outside the except block, so the abort does not chain the error's frames.
        context.abort_with_status(status)

    return wrapper  # type: ignore[return-value]


def _streaming(method: F) -> F:
    @functools.wraps(method)
    def wrapper(
        self: Any, request: Any, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
            return
        except Exception as exc:  # noqa: BLE001
            if _already_aborted(context):
                raise
            status = _failure(exc, context, method.__name__)
        context.abort_with_status(status)

    return wrapper  # type: ignore[return-value]


def _cancellation(context: grpc.ServicerContext) -> Cancellation:
    """Set when the call ends: it is cancelled, its deadline passes, or it is done."""
    gone = Cancellation()
    if not context.add_callback(gone.cancel):
        gone.cancel()  # the call has ended already
    return gone


def _timeout(context: grpc.ServicerContext) -> float | None:
    """How long a wait may last: a little less than the call's deadline, so that the
    server's answer (what it waited for, the group's T) reaches the client before
    the client's own deadline fires with a bare DEADLINE_EXCEEDED."""
    left: float | None = context.time_remaining()
    if left is None:  # grpc's stubs say float; it is None without a deadline
        return None
    return max(0.0, left - min(_ANSWER_EARLY_SECONDS, left / 10))


def _caller(context: grpc.ServicerContext) -> Caller:
    """Who makes the call, as shared-memory segments are bound to it."""
    return Caller(principal_of(context.invocation_metadata()), context.peer())


def _raise_if_cut_off(context: grpc.ServicerContext) -> None:
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


def _stream_header(
    request_iterator: Iterable[Any], part: str, rpc: str, context: Any
) -> tuple[Any, Iterator[Any]]:
    """A stream's header message and the iterator over the chunks after it."""
    it = iter(request_iterator)
    first = next(it, None)
    if first is None:
        _raise_if_cut_off(context)
    if first is None or first.WhichOneof("part") != part:
        what = "header" if part == "header" else f"{part} header"
        raise InvalidArgument(f"{rpc} must begin with its {what}")
    return getattr(first, part), it


def _names(prefix: str, n: int, names: Sequence[str] | None = None) -> list[str]:
    if names is not None:
        return [f"{prefix}_{i + 1} ({name!r})" for i, name in enumerate(names)]
    return [f"{prefix}_{i + 1}" for i in range(n)]


# ListRows pages: ids per page by default and at most, and bytes of rows at most.
_PAGE_SIZE = 1000
_MAX_PAGE_SIZE = 100_000
_PAGE_BYTES = 2 << 20


def _table_tensors(t: pb.IdsTableSpec) -> tuple[list[pb.Tensor], list[str]]:
    """The tensors an ids table spec carries (import): ids, rows, state."""
    if not t.HasField("ids"):
        return [], []
    what = f"ids table {t.name!r}"
    headers = [t.ids, t.rows, *t.state]
    names = [f"{what} ids", f"{what} rows"] + [
        f"{what} state {i + 1}" for i in range(len(t.state))
    ]
    return headers, names


def _empty_table(dim: int, dtype: np.dtype[Any], attrs: Any) -> list[Array]:
    empty = np.empty((0, dim), dtype)
    return [np.empty(0, np.int64), empty] + [empty for _ in attrs.state_names]


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


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Serve ``servicer``'s RPCs on ``server`` (what the generated
    ``add_ParameterServerServiceServicer_to_server`` does), with the chunk-frame
    codec on the streams: received chunks are views (``codec.RawChunk``), and
    encoded frames (``codec.chunk_frames``) are sent as they are."""
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


(_SERVICE,) = pb.DESCRIPTOR.services_by_name.values()


class ParameterServerServicer(pb_grpc.ParameterServerServiceServicer):
    def __init__(
        self,
        store: ParameterStore,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        save: Callable[[], SaveResult] | None = None,
        inflight: InflightBytes | None = None,
        shared_memory: SharedMemory | None = None,
        data_channels: DataChannels | None = None,
        replicate: Replicate | None = None,
    ) -> None:
        self.store = store
        # A replicated shard's log shipping (none without --coordinator).
        self._replicate = replicate
        # The same-host transport (off when not given).
        self._shm = shared_memory or SharedMemory(enabled=False)
        # Tensor bytes on sockets beside gRPC (none when not given).
        self._data = data_channels
        self.chunk_bytes = chunk_bytes
        self._save = save
        # Pull replies are counted in the same budget as requests (see limits).
        self._inflight = inflight or InflightBytes()
        # Streamed pushes receive their gradients into buffers reused per group.
        self.gradient_pool = GradientPool()

    # -- groups --------------------------------------------------------------------
    def _create(
        self,
        req: pb.CreateGroupRequest,
        tensors: list[Array],
        state: list[Array],
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> pb.GroupInfo:
        attrs = attrs_from_proto(req.optimizer)
        names = [t.name for t in req.tensors]
        tables = [table_from_proto(t) for t in req.tables]
        dtype = None
        if req.dtype != pb.DATA_TYPE_UNSPECIFIED:
            dtype = PROTO_TO_DTYPE.get(req.dtype)
            if dtype is None or dtype.kind != "f":
                raise InvalidArgument(
                    f"a group's dtype is FLOAT or DOUBLE, got DataType {req.dtype}"
                )
            dtype = dtype.newbyteorder("=")
            if tensors and tensors[0].dtype != dtype:
                raise InvalidArgument(
                    f"the group's dtype is {dtype}, but its tensors are "
                    f"{tensors[0].dtype}"
                )
        if any(a for a in table_arrays):
            table_arrays = [
                list(a) or _empty_table(t.dim, dtype or np.dtype(np.float32), attrs)
                for t, a in zip(tables, table_arrays, strict=True)
            ]
        else:
            table_arrays = ()
        view = self.store.create_group(
            req.group,
            attrs,
            req.learning_rate,
            list(zip(names, tensors, strict=True)),
            consistency=consistency_from_proto(req.consistency),
            allow_non_finite=req.allow_non_finite,
            state=state,
            update_count=req.update_count,
            lease_seconds=req.lease_seconds or None,
            tables=tables,
            table_arrays=table_arrays,
            dtype=dtype,
        )
        return group_info(view)

    def _check_create_size(self, req: pb.CreateGroupRequest) -> None:
        """Refuse an oversized group from its declared dims, before allocating."""
        nbytes = sum(declared_nbytes(t, f"tensor {t.name!r}") for t in req.tensors)
        kind = req.optimizer.WhichOneof("kind")
        states = {"adagrad": 1, "momentum": 1, "adam": 2}.get(kind or "", 0)
        rows = sum(
            declared_nbytes(t.rows, f"rows of ids table {t.name!r}")
            for t in req.tables
            if t.HasField("rows")
        )
        self.store.check_group_size((nbytes + rows) * (1 + states))
        if not req.tensors and not req.tables:
            raise InvalidArgument(
                f"group {req.group!r} needs at least one tensor or ids table"
            )

    @_unary
    def CreateGroup(
        self, request: pb.CreateGroupRequest, context: Any
    ) -> pb.CreateGroupResponse:
        self._check_create_size(request)
        tensors = [tensor_to_array(t, f"tensor {t.name!r}") for t in request.tensors]
        state = [
            tensor_to_array(t, f"state {i + 1}") for i, t in enumerate(request.state)
        ]
        table_arrays = [
            [tensor_to_array(h, w) for h, w in zip(*_table_tensors(t), strict=True)]
            for t in request.tables
        ]
        return pb.CreateGroupResponse(
            group=self._create(request, tensors, state, table_arrays)
        )

    @_unary
    def CreateGroupStream(
        self, request_iterator: Iterable[pb.CreateGroupStreamRequest], context: Any
    ) -> pb.CreateGroupStreamResponse:
        req, it = _stream_header(
            request_iterator, "header", "a CreateGroupStream", context
        )
        self._check_create_size(req)
        headers = list(req.tensors) + list(req.state)
        names = [f"tensor {t.name!r}" for t in req.tensors] + _names(
            "state", len(req.state)
        )
        per_table = [_table_tensors(t) for t in req.tables]
        for h, w in per_table:
            headers += h
            names += w
        asm = self._assemble(it, headers, names, context)
        n, m = len(req.tensors), len(req.tensors) + len(req.state)
        table_arrays: list[list[Array]] = []
        for h, _ in per_table:
            table_arrays.append(asm[m : m + len(h)])
            m += len(h)
        return pb.CreateGroupStreamResponse(
            group=self._create(
                req, asm[:n], asm[n : len(req.tensors) + len(req.state)], table_arrays
            )
        )

    @_unary
    def DescribeGroup(
        self, request: pb.DescribeGroupRequest, context: Any
    ) -> pb.DescribeGroupResponse:
        return pb.DescribeGroupResponse(
            group=group_info(self.store.describe(request.group))
        )

    @_unary
    def ListGroups(
        self, request: pb.ListGroupsRequest, context: Any
    ) -> pb.ListGroupsResponse:
        return pb.ListGroupsResponse(
            groups=[group_info(v) for v in self.store.groups(request.prefix)]
        )

    @_unary
    def DeleteGroup(
        self, request: pb.DeleteGroupRequest, context: Any
    ) -> pb.DeleteGroupResponse:
        deleted = self.store.delete_group(request.group)
        self.gradient_pool.drop(request.group)
        return pb.DeleteGroupResponse(deleted=deleted)

    @_unary
    def SetLearningRate(
        self, request: pb.SetLearningRateRequest, context: Any
    ) -> pb.SetLearningRateResponse:
        view = self.store.set_learning_rate(request.group, request.learning_rate)
        return pb.SetLearningRateResponse(group=group_info(view))

    # -- push ----------------------------------------------------------------------
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
            self._shm.check(req.reply_region, _caller(context), "reply_region")
        out = self._store_push(req, ticket, grads, context, known_finite)
        reply = reply_type(
            update_count=out.update_count, applied=out.applied, duplicate=out.duplicate
        )
        if out.values is None:
            return reply
        region = None
        if req.HasField("reply_region"):
            region = self._shm.write(req.reply_region, out.values, _caller(context))
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
            timeout=_timeout(context),
            cancellation=_cancellation(context) if req.return_values else None,
        )

    def _validate_push(self, req: pb.PushRequest) -> PushTicket:
        """Check the gradients' header against the group before reading any bytes."""
        specs = (
            tensor_spec(t, f"gradient {i + 1}", encoded=True)
            for i, t in enumerate(req.gradients)
        )
        return self.store.validate_push(req.group, specs)

    @_unary
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

    @_unary
    def PushStream(
        self, request_iterator: Iterable[pb.PushStreamRequest], context: Any
    ) -> pb.PushStreamResponse:
        req, it = _stream_header(request_iterator, "header", "a PushStream", context)
        if req.HasField("gradients_region"):
            raise InvalidArgument(
                "a PushStream carries its gradients as chunks; gradients in shared "
                "memory (gradients_region) go in a unary Push",
                field="header.gradients_region",
            )
        ticket = self._validate_push(req)
        headers = list(req.gradients)
        names = _names("gradient", len(headers), ticket.names)
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
            _raise_if_cut_off(context)
            raise

    def _push_shared(
        self, req: pb.PushRequest, ticket: PushTicket, context: Any
    ) -> pb.PushResponse:
        """A push whose gradients lie in the client's shared-memory segment: the
        store reads them in place."""
        specs = self._bare_specs(req, "in gradients_region")
        names = _names("gradient", len(specs), ticket.names)
        caller = _caller(context)
        with self._shm.read(req.gradients_region, specs, names, caller) as grads:
            return self._push(req, ticket, grads, context, pb.PushResponse)

    # -- the data channel ----------------------------------------------------------
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
        timeout = _timeout(context)
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
                reply = pb.PushResponse(
                    update_count=out.update_count,
                    applied=out.applied,
                    duplicate=out.duplicate,
                )
                if out.values is not None:
                    ch.send(tid, out.values, deadline)
                    reply.values.extend(map(header_tensor, out.values, ticket.names))
                    reply.values_on_channel = True
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

    @_unary
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

    @_streaming
    def Replicate(
        self, request_iterator: Iterable[pb.ReplicateRequest], context: Any
    ) -> Iterator[pb.ReplicateResponse]:
        if self._replicate is None:
            raise FailedPrecondition(
                "this server is not part of a replicated shard (it was started "
                "without --coordinator)",
                reason="NOT_REPLICATED",
            )
        yield from self._replicate(request_iterator, context)

    @_unary
    def SharedMemoryHello(
        self, request: pb.SharedMemoryHelloRequest, context: Any
    ) -> pb.SharedMemoryHelloResponse:
        nonce = self._shm.hello(request.segment, request.key, _caller(context))
        return pb.SharedMemoryHelloResponse(nonce=nonce)

    @_streaming
    def PushPullStream(
        self, request_iterator: Iterable[pb.PushPullStreamRequest], context: Any
    ) -> Iterator[Any]:
        req, it = _stream_header(
            request_iterator, "header", "a PushPullStream", context
        )
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
                    it, headers, _names("gradient", len(headers), ticket.names),
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
                timeout=_timeout(context),
                cancellation=_cancellation(context),
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
            _raise_if_cut_off(context)
            raise

    # -- pull ----------------------------------------------------------------------
    @contextmanager
    def _reply_bytes(self, context: Any, stream: bool) -> Iterator[InflightHold]:
        """What a pull's reply holds of the in-flight budget: released when the call
        ends (its termination callback), when it fails, or when its stream ends."""
        hold = self._inflight.hold()
        if not context.add_callback(hold.release):
            hold.release()
        try:
            yield hold
        except BaseException:
            hold.release()
            raise
        if stream:
            hold.release()

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
            timeout=_timeout(context),
            cancellation=_cancellation(context) if waits else None,
            reserve=functools.partial(hold.admit, what="this pull's reply carries"),
        )

    def _pull_shared(self, req: pb.PullRequest, context: Any) -> pb.PullResponse | None:
        """A pull written straight from the group into the client's segment (one
        copy, under the group's lock); None when it does not fit there."""

        caller = _caller(context)
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
            timeout=_timeout(context),
            cancellation=_cancellation(context) if waits else None,
        )
        if not reply.HasField("tensors_region"):
            return None
        reply.update_count, reply.learning_rate = t, lr
        return reply

    @_unary
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
                return pb.PullResponse(
                    update_count=out.update_count,
                    learning_rate=out.learning_rate,
                    tensors=[
                        header_tensor(a, n)
                        for a, n in zip(arrays, out.names, strict=True)
                    ],
                    tensors_on_channel=True,
                )

    @_streaming
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

    # -- rows ------------------------------------------------------------------------
    @_unary
    def PushRows(
        self, request_iterator: Iterable[pb.PushRowsRequest], context: Any
    ) -> pb.PushRowsResponse:
        req, it = _stream_header(request_iterator, "header", "a PushRows", context)
        headers: list[pb.Tensor] = []
        names: list[str] = []
        for j, gr in enumerate(req.gradients):
            if gr.HasField("indices"):
                headers.append(gr.indices)
                names.append(f"gradients[{j}].indices ({gr.name!r})")
            headers.append(gr.values)
            names.append(f"gradients[{j}].values ({gr.name!r})")
        self.store.validate_push_rows(
            req.group,
            (
                (
                    gr.name,
                    tensor_spec(gr.indices, f"gradients[{j}].indices")
                    if gr.HasField("indices")
                    else None,
                    tensor_spec(gr.values, f"gradients[{j}].values", encoded=True),
                )
                for j, gr in enumerate(req.gradients)
            ),
        )
        arrays = iter(self._assemble(it, headers, names, context, encoded=True))
        gradients: dict[str, Array | tuple[Array, Array]] = {}
        for gr in req.gradients:
            if gr.HasField("indices"):
                gradients[gr.name] = (next(arrays), next(arrays))
            else:
                gradients[gr.name] = next(arrays)
        out = self.store.push_rows(
            req.group,
            gradients,
            client_id=req.client_id,
            seq=req.seq,
            base_version=req.base_version if req.HasField("base_version") else None,
            learning_rate=req.learning_rate if req.HasField("learning_rate") else None,
        )
        return pb.PushRowsResponse(
            update_count=out.update_count, applied=out.applied, duplicate=out.duplicate
        )

    @_streaming
    def PullRows(
        self, request_iterator: Iterable[pb.PullRowsRequest], context: Any
    ) -> Iterator[Any]:
        req, it = _stream_header(request_iterator, "header", "a PullRows", context)
        headers = [sel.indices for sel in req.tensors]
        names = [f"tensors[{j}].indices" for j in range(len(headers))]
        for h, what in zip(headers, names, strict=True):
            dtype, dims = tensor_spec(h, what)
            if dtype != np.int64 or len(dims) != 1:
                raise InvalidArgument(
                    f"{what} must be int64 of shape (k,), got {dtype} {list(dims)}"
                )
        indices = self._assemble(it, headers, names, context)
        selections = {
            sel.name: idx for sel, idx in zip(req.tensors, indices, strict=True)
        }
        if len(selections) != len(headers):
            raise InvalidArgument("a PullRows names each tensor at most once")
        waits = req.HasField("min_version")
        with self._reply_bytes(context, stream=True) as hold:
            out = self.store.pull_rows(
                req.group,
                selections,
                with_state=req.with_state,
                min_version=req.min_version if waits else None,
                timeout=_timeout(context),
                cancellation=_cancellation(context) if waits else None,
                reserve=functools.partial(hold.admit, what="this pull's reply carries"),
            )
            header = pb.PullRowsReply(
                update_count=out.update_count,
                rows=[
                    header_tensor(a, n)
                    for a, n in zip(out.arrays, out.names, strict=True)
                ],
            )
            yield pb.PullRowsResponse(header=header)
            yield from chunk_frames(pb.PullRowsResponse, out.arrays, self.chunk_bytes)

    @_unary
    def ListRows(
        self, request: pb.ListRowsRequest, context: Any
    ) -> pb.ListRowsResponse:
        after = None
        if request.page_token:
            try:
                after = int(request.page_token)
            except ValueError:
                raise InvalidArgument(
                    f"page_token {request.page_token!r} is not one a ListRows "
                    "returned; pass an empty token to start from the first id"
                ) from None
        size = min(request.page_size or _PAGE_SIZE, _MAX_PAGE_SIZE)
        if request.with_values:
            row = self.store.describe(request.group)
            dims = {t.name: t.definition.dim for t in row.tables}
            states = len(row.attrs.state_names) if request.with_state else 0
            per_row = dims.get(request.table, 1) * row.dtype.itemsize * (1 + states)
            size = max(1, min(size, _PAGE_BYTES // per_row))
        page = self.store.list_rows(
            request.group,
            request.table,
            after=after,
            limit=size,
            with_values=request.with_values,
            with_state=request.with_state,
        )
        reply = pb.ListRowsResponse(
            next_page_token="" if page.next_after is None else str(page.next_after),
            row_count=page.row_count,
            update_count=page.update_count,
        )
        write_tensor(reply.ids, page.ids)
        for a, n in zip(page.rows, page.names, strict=True):
            write_tensor(reply.rows.add(), a, n)
        return reply

    # -- apply ---------------------------------------------------------------------
    def _apply(self, req: pb.ApplyRequest, inputs: list[Array]) -> list[Array]:
        attrs = attrs_from_proto(req.optimizer)
        return apply_onnx(attrs.op, attrs, inputs)

    @_unary
    def Apply(self, request: pb.ApplyRequest, context: Any) -> pb.ApplyResponse:
        inputs = [
            tensor_to_array(t, f"input {i}") for i, t in enumerate(request.inputs)
        ]
        outputs = self._apply(request, inputs)
        reply = pb.ApplyResponse()
        for o in outputs:
            write_tensor(reply.outputs.add(), o)
        return reply

    @_streaming
    def ApplyStream(
        self, request_iterator: Iterable[pb.ApplyStreamRequest], context: Any
    ) -> Iterator[Any]:
        request, it = _stream_header(
            request_iterator, "request", "an ApplyStream", context
        )
        headers = list(request.inputs)
        for i, t in enumerate(headers):
            tensor_spec(t, f"input {i}")
        inputs = self._assemble(
            it, headers, [f"input {i}" for i in range(len(headers))], context
        )
        outputs = self._apply(request, inputs)
        yield pb.ApplyStreamResponse(
            response=pb.ApplyResponse(outputs=[header_tensor(o) for o in outputs])
        )
        yield from chunk_frames(pb.ApplyStreamResponse, outputs, self.chunk_bytes)

    # -- workers and saving ----------------------------------------------------------
    def _lease(self, lease: LeaseView, reply_type: type[L]) -> L:
        return reply_type(
            lease_seconds=lease.lease_seconds,
            update_count=lease.update_count,
            live_workers=lease.live_workers,
            quorum=lease.quorum,
        )

    @_unary
    def JoinGroup(
        self, request: pb.JoinGroupRequest, context: Any
    ) -> pb.JoinGroupResponse:
        lease = self.store.join(request.group, request.worker_id)
        return self._lease(lease, pb.JoinGroupResponse)

    @_unary
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Any
    ) -> pb.HeartbeatResponse:
        lease = self.store.join(request.group, request.worker_id)
        return self._lease(lease, pb.HeartbeatResponse)

    @_unary
    def LeaveGroup(
        self, request: pb.LeaveGroupRequest, context: Any
    ) -> pb.LeaveGroupResponse:
        lease = self.store.leave(request.group, request.worker_id)
        return self._lease(lease, pb.LeaveGroupResponse)

    @_unary
    def Save(self, request: pb.SaveRequest, context: Any) -> pb.SaveResponse:
        if self._save is None:
            # Not UNAVAILABLE: the client retries that, and no retry will help.
            raise FailedPrecondition(
                "this server keeps no data directory (started with --durability none):"
                " start it with --data-dir and --durability snapshot or wal to save"
            )
        saved = self._save()
        return pb.SaveResponse(path=saved.path, groups=saved.groups, bytes=saved.bytes)


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
