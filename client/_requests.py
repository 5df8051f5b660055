"""What both clients do, written once: requests, replies, transports, deadlines, errors.

Every call is an *operation*: a generator that builds its requests, yields the
effects it needs (``Call``: one RPC; ``Pause``: wait before a resend; ``Parallel``:
run several operations at once, e.g. one per shard of a cluster) and returns the
decoded reply. ``Client`` performs the effects with blocking grpc calls (and a
thread pool) and ``AsyncClient`` with ``grpc.aio`` coroutines (and tasks); neither
knows anything about a request or a reply. Operations compose with ``yield from``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import json
import logging
import math
import os
import ssl
import time
import uuid
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, Protocol, TypeVar, overload

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ._datachannel import (
    ChannelBroken,
    ChannelPool,
    ChannelRefused,
    DataChannel,
    connect,
    split_frame,
    tls_context,
)
from ._encoding import (
    ENCODED,
    ENCODING_TO_PROTO,
    DeferredEncoding,
    Encoding,
    check_encoding,
    encode,
    widen_into,
)
from ._errors import (
    ClientClosedError,
    DataChannelError,
    DeadlineExceededError,
    FailedPreconditionError,
    RpcError,
    SharedMemoryError,
    UnavailableError,
    translate,
)
from ._optimizers import Async, OptimizerSpec, Sync
from ._records import (
    GroupInfo,
    LeaseInfo,
    PushResult,
    RowsPage,
    SaveInfo,
    group_info,
    initializer_to_proto,
    lease_info,
)
from ._transfer import export_op, import_op
from .codec import (
    CHUNK_BYTES,
    DTYPE_TO_PROTO,
    SERVICE,
    SHARD_METADATA_KEY,
    TensorAssembler,
    TensorFormatError,
    chunk_frames,
    deserializer,
    header_tensor,
    rpc_messages,
    serializer,
    tensor_spec,
    tensor_to_array,
    write_tensor,
)
from .initializers import IdsTable
from .shm import (
    Segment,
    SegmentPool,
    SharedMemoryMode,
    TensorBuffers,
    hello_segment,
    layout,
    sweep_orphans,
)

__all__ = [
    "SPLIT_BYTES",
    "STREAM_THRESHOLD_BYTES",
    "Call",
    "ClientCore",
    "Deadline",
    "Effect",
    "Op",
    "OpRun",
    "Parallel",
    "Pause",
    "PushCall",
    "State",
    "Transport",
    "as_method",
    "channel_credentials",
    "channel_options",
    "multicallable",
    "on_shard",
    "parallel",
    "row_gradients",
]

log = logging.getLogger("onnxps.client")

Array = np.ndarray[Any, Any]
Transport = Literal["auto", "unary", "stream"]
R = TypeVar("R")

STREAM_THRESHOLD_BYTES = 1 << 20
# With shared_memory="auto", tensors of a call at least this large go through shared
# memory (below it, inline bytes cost less than mapping a segment on the server).
SHARED_MEMORY_THRESHOLD_BYTES = 64 << 10
_SHM_MODES = ("auto", "on", "off")
DataChannelMode = Literal["auto", "on", "off"]
_F32 = np.dtype(np.float32)
# With data_channel="auto", calls with at least this many tensor bytes use it.
DATA_CHANNEL_THRESHOLD_BYTES = 1 << 20
# Refusals of a data channel's hello that mean "not this server": use gRPC.
_DATA_HELLO_REFUSALS = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
_HELLO_SECONDS = 3.0
_CHANNEL_FALLBACK_REASONS = frozenset(
    {
        "DATA_CHANNEL_UNKNOWN",
        "DATA_CHANNEL_BUSY",
        "DATA_CHANNEL_OFF",
        "DATA_TRANSFER_STALE",
    }
)
# Refusals of a hello that mean "not here": the client falls back to bytes.
_HELLO_REFUSALS = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
)
SPLIT_BYTES = 64 << 20  # a cluster splits a group whose X is larger
_RESEND_BACKOFF_MAX = 2.0  # seconds between a push's resends, at most
_RESEND_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

# The one retry mechanism for every call: the channel retries UNAVAILABLE (the server
# is down or draining), within the call's deadline. A push is also resent, with the
# same (client_id, seq), while UNAVAILABLE reaches the client after the channel gave
# up (e.g. a stream the channel cannot replay), until its deadline: the server applies
# it exactly once. The calls that are safe to repeat (reads, and pushes, which the
# server deduplicates) are also retried on CANCELLED: a server that stops cancels the
# calls it had received but not yet started, and none of them ran.
_SAFE_TO_REPEAT = (
    "Push",
    "PushStream",
    "PushPullStream",
    "Pull",
    "SharedMemoryHello",
    "PullStream",
    "DescribeGroup",
    "ListGroups",
    "Heartbeat",
    "Apply",
    "ApplyStream",
)


def _retry_policy(*codes: str) -> dict[str, Any]:
    return {
        "maxAttempts": 5,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": list(codes),
    }


_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": m} for m in _SAFE_TO_REPEAT],
            "retryPolicy": _retry_policy("UNAVAILABLE", "CANCELLED"),
        },
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": _retry_policy("UNAVAILABLE"),
        },
    ]
}
# A restarted server is found within about two seconds (gRPC's default reconnect
# backoff grows to two minutes, longer than any push waits).
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def channel_options(server_name_override: str | None) -> list[tuple[str, Any]]:
    """The options of every channel either client opens."""
    options = list(_CHANNEL_OPTIONS)
    if server_name_override:
        options.append(("grpc.ssl_target_name_override", server_name_override))
    return options


_TRANSPORTS = ("auto", "unary", "stream")


def _check_client_arguments(
    client: str,
    address: Any,
    timeout: Any,
    transport: Any,
    chunk_bytes: Any,
    root_certificates: Any,
    unexpected: Mapping[str, Any],
    shared_memory: Any = "off",
) -> None:
    """TypeError/ValueError that say what ``Client(...)`` (or ``AsyncClient``)
    takes."""
    if unexpected:
        names = ", ".join(sorted(unexpected))
        raise TypeError(
            f"{client}() got unexpected argument(s) {names}: it takes the server "
            "address ('host:port') and connection options (timeout=, token=, TLS, "
            "transport=); tensors are given to create_group(), gradients to push()"
        )
    if isinstance(address, list | tuple) and address:  # a cluster's shards
        bad = [a for a in address if not (isinstance(a, str) and a.strip())]
        if bad:
            raise TypeError(
                f"{client}(address): the server's 'host:port' as a string, or a "
                "cluster's shards as a list of them in shard order; the list holds "
                f"{type(bad[0]).__name__}"
            )
    elif not isinstance(address, str) or not address.strip():
        raise TypeError(
            f"{client}(address): the server's 'host:port' as a string, e.g. "
            f"{client}('127.0.0.1:50051'), or a cluster's shards as a list of them, "
            f"got {type(address).__name__}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout is seconds (a number), got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if transport not in _TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}"
        )
    if shared_memory not in _SHM_MODES:
        raise ValueError(
            f"shared_memory must be one of {', '.join(_SHM_MODES)}, got "
            f"{shared_memory!r}"
        )
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    if root_certificates is not None and not isinstance(root_certificates, bytes):
        raise TypeError(
            "root_certificates is the PEM bytes of the CA, not a path: pass "
            "open(path, 'rb').read()"
        )


def _spec(value: Any, what: str, kind: Any = (Async, Sync)) -> Any:
    """``value`` when it is an instance of ``kind`` (or has its ``to_proto``); else
    a TypeError that says so (the class itself, ``Adam`` for ``Adam()``, is the usual
    slip)."""
    if isinstance(value, type):
        raise TypeError(
            f"{what} must be an instance, e.g. {value.__name__}(), not the class "
            f"{value.__name__}"
        )
    if not isinstance(value, kind) and not callable(getattr(value, "to_proto", None)):
        names = (
            "Adagrad(), Momentum(), Nesterov() or Adam()"
            if kind is OptimizerSpec
            else "Async() or Sync(workers)"
        )
        raise TypeError(f"{what} must be one of {names}, got {value!r}")
    return value


def _named_tensors(tensors: Any) -> list[tuple[str, Any]]:
    """``{name: array}`` or ``[(name, array), ...]`` as a list of pairs."""
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        items = None
    else:
        items = list(tensors)
    if items is None or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items
    ):
        raise TypeError(
            "tensors must name each tensor, in the ONNX order: {'w': w0, 'b': b0} "
            "or [('w', w0), ('b', b0)]"
        )
    return items


def channel_credentials(
    tls: tuple[bytes | None, bytes | None, bytes | None],
) -> grpc.ChannelCredentials | None:
    """TLS credentials from (root certificates, private key, chain); None: plaintext."""
    roots, key, chain = tls
    if roots is None and chain is None:
        return None
    return grpc.ssl_channel_credentials(roots, key, chain)


def multicallable(channel: Any, method: str) -> Any:
    """``channel``'s callable for one RPC (blocking or ``grpc.aio``), whose stream
    messages may be encoded chunk frames (``codec.chunk_frames``) and whose received
    chunks are read as views (``codec.RawChunk``)."""
    request, reply, req_s, resp_s = rpc_messages(method)
    kind = ("unary" if not req_s else "stream") + (
        "_unary" if not resp_s else "_stream"
    )
    return getattr(channel, kind)(
        f"/{SERVICE}/{method}",
        request_serializer=serializer(request),
        response_deserializer=deserializer(reply),
        _registered_method=True,
    )


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


class _TensorStreamReader:
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
    thread, so the event loop never waits on it."""

    fn: Callable[[], Any]


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
    """Name ``method``, which runs the operation ``op``, as ``owner``'s public call
    (``inspect.signature`` and ``help`` show the operation's)."""
    functools.update_wrapper(method, op)
    method.__name__ = name or op.__name__.removeprefix("_")
    method.__qualname__ = f"{owner}.{method.__name__}"


def _unary(msg: Any) -> Callable[[], Any]:
    return lambda: msg


class State(enum.Enum):
    UNOPENED = 1
    OPEN = 2
    CLOSED = 3


class ClientCore:
    """Settings and per-client state both clients share, and every operation."""

    # Whether this client performs ``Transfer`` (data channel) effects.
    TRANSFERS = True
    # Whether an encoded pull on the data channel is widened block by block as it
    # lands (else the whole frame first: benchmarks/encode_overlap_ab.py's
    # baseline).
    _WIDENS_AS_IT_LANDS = True

    def __init__(
        self,
        address: str | Sequence[str] = "",  # required: a default only to say so
        *,
        timeout: float = 60.0,
        client_id: str | None = None,
        token: str | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        server_name_override: str | None = None,
        transport: Transport = "auto",
        stream_threshold_bytes: int = STREAM_THRESHOLD_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        split_bytes: int = SPLIT_BYTES,
        shared_memory: SharedMemoryMode = "auto",
        gradient_encoding: Encoding | None = None,
        pull_encoding: Encoding | None = None,
        data_channel: DataChannelMode = "auto",
        **unexpected: NoReturn,
    ) -> None:
        _check_client_arguments(
            type(self).__name__,
            address,
            timeout,
            transport,
            chunk_bytes,
            root_certificates,
            unexpected,
            shared_memory,
        )
        # A list of addresses is a cluster: shard i at addresses[i] (README, "A
        # cluster of shards").
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.address = ",".join(self.addresses)
        self.shards: int | None = (
            None if isinstance(address, str) else len(self.addresses)
        )
        self.split_bytes = split_bytes
        self.timeout = timeout
        self.client_id = client_id or uuid.uuid4().hex
        self.transport: Transport = transport
        self.stream_threshold_bytes = stream_threshold_bytes
        self.chunk_bytes = chunk_bytes
        # How gradients and pulled X travel unless a call says (README, "Compressed
        # gradients on the wire"): None is native.
        self.gradient_encoding = check_encoding(gradient_encoding, "gradient_encoding")
        self.pull_encoding = check_encoding(pull_encoding, "pull_encoding")
        self._token = token
        self._tls = (root_certificates, private_key, certificate_chain)
        self._server_name_override = server_name_override
        # Seqs start at the wall clock in microseconds, not 1: a worker restarted with
        # the same client_id must not repeat seqs the server remembers, or its first
        # pushes would be answered as duplicates and silently dropped.
        self._seq = itertools.count(time.time_ns() // 1000)
        self._sizes: dict[str, int] = {}
        self._dtypes: dict[str, np.dtype[Any]] = {}  # each group's, as last seen
        # group -> segment bytes its pull needs without and with state
        self._pull_segments: dict[str, tuple[int, int]] = {}
        # The same-host transport: "auto" (with transport="auto") tries it for
        # calls of at least SHARED_MEMORY_THRESHOLD_BYTES and falls back to bytes
        # where the hello is refused; "on" uses it for every push and pull and
        # raises SharedMemoryError where it cannot work; "off" never uses it.
        self.shared_memory: SharedMemoryMode = shared_memory
        self._shm_pool: SegmentPool | None = None
        self._shm_refused: str | None = None
        # TensorBuffers this client made (closed with it); a push or pull of them
        # moves no tensor bytes through the client.
        self._buffers_made: weakref.WeakSet[TensorBuffers] = weakref.WeakSet()
        # The data channel (README "The data channel"): "auto" (with
        # transport="auto") carries the bytes of native calls of at least
        # DATA_CHANNEL_THRESHOLD_BYTES on sockets beside gRPC when the server
        # offers them, "on" every push and pull (DataChannelError where it cannot),
        # "off" never. Shared memory, where it works, goes first.
        if data_channel not in _SHM_MODES:
            raise ValueError(
                f"data_channel must be one of {', '.join(_SHM_MODES)}, got "
                f"{data_channel!r}"
            )
        self.data_channel: DataChannelMode = data_channel
        self._data_pools: dict[int, ChannelPool] = {}  # per shard (0: one server)
        self._data_refused: dict[int, str] = {}
        self._data_tls: ssl.SSLContext | None = None
        self._state = State.UNOPENED
        self._setup()

    def _setup(self) -> None:
        """The connection state of the concrete client."""

    def _check_open(self) -> None:
        if self._state is State.CLOSED:
            raise ClientClosedError(
                f"this client was closed; create a new {type(self).__name__}"
            )

    def _metadata(self, shard: int = 0) -> list[tuple[str, str]] | None:
        md = [("authorization", f"Bearer {self._token}")] if self._token else []
        if self.shards is not None:
            md.append((SHARD_METADATA_KEY, f"{shard}/{self.shards}"))
        return md or None

    @staticmethod
    def _encoding(value: Any, default: Encoding, what: str) -> Encoding:
        return default if value is None else check_encoding(value, what)

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout)

    def _use_stream(self, nbytes: int) -> bool:
        if self.transport == "auto":
            return nbytes > self.stream_threshold_bytes
        return self.transport == "stream"

    def _unary_op(self, method: str, request: Any, timeout: float | None) -> Op[Any]:
        return (
            yield Call(method, _unary(request), self._deadline(timeout), what(method))
        )

    @staticmethod
    def _call_op(call: Call) -> Op[Any]:
        return (yield call)

    # -- groups --------------------------------------------------------------------
    def _create_group(
        self,
        name: str,
        optimizer: OptimizerSpec,
        *,
        learning_rate: float,
        tensors: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        consistency: Async | Sync | None = None,
        allow_non_finite: bool = False,
        state: Sequence[Any] | None = None,
        update_count: int = 0,
        lease_seconds: float | None = None,
        tables: Mapping[str, IdsTable] | None = None,
        table_rows: Sequence[Sequence[Any]] | None = None,
        timeout: float | None = None,
    ) -> Op[GroupInfo]:
        """Create a group; the order of ``tensors`` is the ONNX order from then on.

        ``state`` (V_1..V_n then H_1..H_n, as the operator has them) and
        ``update_count`` resume a group whose optimizer state was saved elsewhere.
        ``tables`` adds ids tables (``IdsTable``: rows keyed by int64 ids, created
        on first push); ``table_rows`` resumes them: per table its ids (ascending),
        X rows, then V rows, H rows as the operator has them.
        """
        items = _named_tensors(tensors or {})
        arrays = [np.asarray(a) for _, a in items]
        state_arrays = [np.asarray(a) for a in state or ()]
        specs, table_arrays = _table_specs(tables or {}, table_rows, arrays)
        req = pb.CreateGroupRequest(
            group=name,
            optimizer=_spec(optimizer, "optimizer", OptimizerSpec).to_proto(),
            learning_rate=learning_rate,
            consistency=_spec(consistency or Async(), "consistency").to_proto(),
            allow_non_finite=allow_non_finite,
            update_count=update_count,
            lease_seconds=lease_seconds or 0.0,
            tables=specs,
        )
        if not arrays and specs:
            dtype = next(
                (t.dtype for t in (tables or {}).values() if t.dtype is not None),
                np.float32,
            )
            req.dtype = DTYPE_TO_PROTO[np.dtype(dtype).newbyteorder("<")]
        names = [n for n, _ in items]
        deadline = self._deadline(timeout)
        return (
            yield from self._create_parts(
                req, names, arrays, state_arrays, deadline, table_arrays=table_arrays
            )
        )

    def _create_parts(
        self,
        req: pb.CreateGroupRequest,
        names: list[str],
        arrays: list[Array],
        state_arrays: list[Array],
        deadline: Deadline,
        *,
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> Op[GroupInfo]:
        """Create the group (a cluster client: its parts, on their shards)."""
        msg = yield from self._create_op(
            req, names, arrays, state_arrays, deadline, table_arrays=table_arrays
        )
        return self._remember(group_info(msg))

    def _create_op(
        self,
        template: pb.CreateGroupRequest,
        names: Sequence[str],
        arrays: Sequence[Array],
        state_arrays: Sequence[Array],
        deadline: Deadline,
        *,
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> Op[pb.GroupInfo]:
        """One CreateGroup(Stream) of ``template`` with these tensors (and the rows
        of its ids tables, ``table_arrays``): the reply's group."""
        req = pb.CreateGroupRequest()
        req.CopyFrom(template)
        arrays = list(arrays)
        state_arrays = list(state_arrays)
        rows = [a for t in table_arrays for a in t]
        if self._use_stream(sum(a.nbytes for a in arrays + state_arrays + rows)):
            req.tensors.extend(map(header_tensor, arrays, names))
            req.state.extend(header_tensor(a) for a in state_arrays)
            for spec, (ids, x, *st) in zip(req.tables, table_arrays, strict=False):
                spec.ids.CopyFrom(header_tensor(ids))
                spec.rows.CopyFrom(header_tensor(x))
                spec.state.extend(header_tensor(a) for a in st)
            chunks = self._chunks(
                pb.CreateGroupStreamRequest, req, arrays + state_arrays + rows
            )
            call = Call(
                "CreateGroupStream", chunks, deadline, what("CreateGroupStream")
            )
        else:
            for n, a in zip(names, arrays, strict=True):
                write_tensor(req.tensors.add(), a, n)
            for a in state_arrays:
                write_tensor(req.state.add(), a)
            for spec, (ids, x, *st) in zip(req.tables, table_arrays, strict=False):
                write_tensor(spec.ids, ids)
                write_tensor(spec.rows, x)
                for a in st:
                    write_tensor(spec.state.add(), a)
            call = Call("CreateGroup", _unary(req), deadline, what("CreateGroup"))
        msg = yield call
        group: pb.GroupInfo = msg.group
        return group

    def _chunks(
        self, message: Any, header: Any, arrays: list[Array]
    ) -> Callable[[], Iterator[Any]]:
        """A client stream: the header, then every array in chunks."""
        field = "request" if message is pb.ApplyStreamRequest else "header"

        def chunks() -> Iterator[Any]:
            yield message(**{field: header})
            yield from chunk_frames(message, arrays, self.chunk_bytes)

        return chunks

    def _remember(self, info: GroupInfo) -> GroupInfo:
        self._sizes[info.name] = info.nbytes
        self._dtypes[info.name] = info.dtype
        sizes = [
            int(np.prod(dims, dtype=np.int64)) * info.dtype.itemsize
            for _, dims in info.tensors
        ]
        # with state: X, V and H at most (Adam)
        self._pull_segments[info.name] = (layout(sizes)[1], layout(sizes * 3)[1])
        return info

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        return self._describe(name, self._deadline(timeout))

    def _describe(self, name: str, deadline: Deadline) -> Op[GroupInfo]:
        req = pb.DescribeGroupRequest(group=name)
        msg = yield Call("DescribeGroup", _unary(req), deadline, what("DescribeGroup"))
        return self._remember(group_info(msg.group))

    def _list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> Op[list[GroupInfo]]:
        req = pb.ListGroupsRequest(prefix=prefix)
        msg = yield from self._unary_op("ListGroups", req, timeout)
        return [group_info(g) for g in msg.groups]

    def _delete_group(self, name: str, *, timeout: float | None = None) -> Op[bool]:
        self._sizes.pop(name, None)
        req = pb.DeleteGroupRequest(group=name)
        msg = yield from self._unary_op("DeleteGroup", req, timeout)
        return bool(msg.deleted)

    def _set_learning_rate(
        self, name: str, learning_rate: float, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        req = pb.SetLearningRateRequest(group=name, learning_rate=learning_rate)
        msg = yield from self._unary_op("SetLearningRate", req, timeout)
        return group_info(msg.group)

    # -- push ----------------------------------------------------------------------
    def _push_detailed(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        encoding: Encoding | None = None,
        timeout: float | None = None,
        out: Sequence[Any] | None = None,
    ) -> Op[PushResult]:
        """Like ``push``, with everything the server said about it.

        ``encoding`` ("bfloat16", "float16", "native"; None: the client's
        ``gradient_encoding``) sends the gradients in 2 bytes per element, rounded
        to nearest even here; the server widens them exactly to the group's dtype.
        A finite gradient the encoding cannot hold raises ``EncodingRangeError``.

        ``out`` (with ``return_values=True``): arrays to receive X_1..X_n, one per
        gradient, of its shape and dtype, writable (ValueError otherwise, before
        anything is sent); they are the result's values. A streamed reply is
        assembled straight into them (no copy when they are C-contiguous), a
        shared-memory or inline one is copied into them once. If the push raises,
        their contents are unspecified (some chunks of X may have landed): pull
        to have the server's X again."""
        # Built now, not when first stepped: its deadline and seq start with the
        # call, and a unary push has copied the gradients before it returns.
        deadline = self._deadline(timeout)
        enc = self._encoding(encoding, self.gradient_encoding, "encoding")
        if out is not None:
            out = _reply_arrays(out, gradients, return_values)
        if enc != "native" and self._defers_encoding():
            # encoded block by block as the data channel sends it, or all at once
            # (``_push_op``) if the push goes another way
            arrays: list[Any] = [
                DeferredEncoding(g, enc, f"gradient {i + 1}")
                for i, g in enumerate(gradients)
            ]
        else:
            arrays = [
                encode(g, enc, f"gradient {i + 1}") for i, g in enumerate(gradients)
            ]
        req = pb.PushRequest(
            group=group,
            client_id=self.client_id,
            seq=next(self._seq),
            return_values=return_values,
        )
        if base_version is not None:
            req.base_version = base_version
        if learning_rate is not None:
            req.learning_rate = learning_rate
        result = yield from self._push_parts(req, arrays, deadline, out)
        if out is None or result.values is None:
            return result
        return dataclasses.replace(result, values=_written_into(out, result.values))

    def _defers_encoding(self) -> bool:
        """Whether an encoded push may leave its encoding to the data channel's
        sending (a single server that may give a channel)."""
        return self.TRANSFERS and self.data_channel != "off" and self.shards is None

    def _push_parts(
        self,
        req: pb.PushRequest,
        arrays: list[Array],
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[PushResult]:
        """Send the push (a cluster client: its parts, to their shards). ``out``:
        arrays X may be written straight into (the caller checked them)."""
        pool = None
        if all(a.dtype.kind == "f" for a in arrays):  # not an encoded push
            pool = yield from self._shared_memory(
                sum(a.nbytes for a in arrays), deadline
            )
        sizes = [a.nbytes for a in arrays]
        bufs = self._buffers_of(arrays) if pool is not None else None
        if pool is not None and bufs is not None:
            return (yield from self._push_buffers_op(pool, bufs, req, deadline, out))
        segs = self._segments(pool, sizes, 2 if req.return_values else 1)
        if pool is not None and segs is not None:
            return (
                yield from self._push_shared_op(pool, segs, req, arrays, deadline, out)
            )
        ch = yield from self._data_channel_for(sum(sizes), deadline)
        if ch is not None:  # native or encoded: the server widens as blocks land
            pushed = self._push_channel_op(ch, req, arrays, deadline, out)
            return (yield from pushed)
        return (yield from self._push_op(req, arrays, deadline, out))

    def _push_channel_op(
        self,
        ch: DataChannel,
        template: pb.PushRequest,
        arrays: Sequence[Array],
        deadline: Deadline,
        out: Sequence[Array] | None,
        shard: int = 0,
    ) -> Op[PushResult]:
        """A push whose gradients (and X) travel on data channel ``ch`` (to
        ``shard``). Where the channel fails without the server saying why, the
        push is resent over gRPC (the same seq: applied once)."""
        req = pb.PushRequest()
        req.CopyFrom(template)
        req.gradients.extend(header_tensor(a) for a in arrays)
        tid = ch.next_transfer()
        req.transfer.channel = ch.id
        req.transfer.transfer_id = tid
        into: list[Array] | None = None
        if req.return_values:
            into = [
                out[i] if out is not None and out[i].flags.c_contiguous else
                np.empty(a.shape, ENCODED.get(a.dtype, (a.dtype,))[0])
                for i, a in enumerate(arrays)
            ]  # fmt: skip
        what = f"the push to group {req.group} (seq {req.seq}) was not answered"
        call = Call("Push", _unary(req), deadline, what)
        try:
            msg, frame = yield Transfer(call, ch, tid, arrays, req.return_values, into)
        except (ChannelBroken, UnavailableError, FailedPreconditionError) as exc:
            if isinstance(exc, FailedPreconditionError) and (
                exc.reason not in _CHANNEL_FALLBACK_REASONS
            ):
                raise
            log.info("data channel: %s; the push goes over gRPC", exc)
            return (yield from self._push_op(template, arrays, deadline, out))
        self._data_pool(shard).give_back(ch)
        values = None
        if req.return_values and msg.values_on_channel:
            values = (
                frame
                if isinstance(frame, list)
                else split_frame(frame, [tensor_spec(t, t.name) for t in msg.values])
            )
        elif req.return_values:
            values = _inline_values(msg.values, out)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, values)

    def _push_part_op(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Array],
        deadline: Deadline,
        shard: int,
    ) -> Op[PushResult]:
        """One part's push to ``shard`` of a cluster (the caller routes it there
        with ``on_shard``): on the shard's data channel when it has one."""
        nbytes = sum(a.nbytes for a in arrays)
        ch = yield from self._data_channel_for(nbytes, deadline, shard)
        if ch is not None:
            op = self._push_channel_op(ch, template, arrays, deadline, None, shard)
            return (yield from op)
        return (yield from self._push_op(template, arrays, deadline))

    def _data_pool(self, shard: int) -> ChannelPool:
        pool = self._data_pools.get(shard)
        if pool is None:
            pool = self._data_pools.setdefault(shard, ChannelPool())
        return pool

    def _data_channel_for(
        self, nbytes: int, deadline: Deadline, shard: int = 0
    ) -> Op[DataChannel | None]:
        """A data channel to ``shard`` (0: the one server) for a call of
        ``nbytes`` tensor bytes, or None (bytes over gRPC): an idle one, else a
        new one (hello, connect)."""
        if self.data_channel == "off" or not self.TRANSFERS:
            return None
        if self.data_channel == "auto" and (
            self.transport != "auto" or nbytes < DATA_CHANNEL_THRESHOLD_BYTES
        ):
            return None
        host = _tcp_host(self.addresses[shard])
        if host is None:
            return self._refuse_data_channel("the address is not host:port", shard)
        if shard in self._data_refused:
            return self._refuse_data_channel(self._data_refused[shard], shard)
        ch = self._data_pool(shard).take()
        if ch is not None:
            return ch
        try:
            call = Call(
                "DataChannelHello",
                _unary(pb.DataChannelHelloRequest()),
                # A hello never costs the call more than a few seconds of its own
                Deadline(min(deadline.remaining(), _HELLO_SECONDS)),
                what("the data channel hello"),
            )
            msg = yield call
        except RpcError as exc:
            if exc.code in _DATA_HELLO_REFUSALS:
                why = f"{exc.code.name}: {exc.details}"
                return self._refuse_data_channel(why, shard)
            # The server is away, draining or stopped: this call goes over gRPC
            # (and rides through that, or times out, as before); the next call
            # asks again.
            return None
        try:
            tls = None
            if self._tls[0] is not None or self._tls[2] is not None:
                tls = self._data_tls
                if tls is None:
                    tls = self._data_tls = tls_context(*self._tls)
            timeout = min(deadline.remaining(), 10)
            override = self._server_name_override
            opening = functools.partial(
                connect, host, msg.port, msg.ticket, timeout, tls, override
            )
            opened: DataChannel = yield Blocking(opening)
            return opened
        except (OSError, ChannelRefused, ChannelBroken) as exc:
            why = f"cannot connect to its port {host}:{msg.port} ({exc})"
            return self._refuse_data_channel(why, shard)

    def _refuse_data_channel(self, why: str, shard: int = 0) -> DataChannel | None:
        """Remember why ``shard`` gives no data channel: "on" raises, "auto" falls
        back to gRPC (logged once); None."""
        first = shard not in self._data_refused
        self._data_refused[shard] = why
        address = self.addresses[shard]
        if self.data_channel == "on":
            raise DataChannelError(
                f"data_channel='on' but the server at {address} gives this "
                f"client no data channel: {why}"
            )
        if first:
            log.info(
                "no data channel with %s (%s); tensor bytes go over gRPC",
                address,
                why,
            )
        return None

    def _push_op(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Array],
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[PushResult]:
        """One push of ``template`` with these gradients, resent while unanswered.

        On the stream transport a push that returns X is a PushPullStream: X comes
        back in chunks, sent while the server steps (into ``out`` where given)."""
        req = pb.PushRequest()
        req.CopyFrom(template)
        group = req.group
        what = f"the push to group {group} (seq {req.seq}) was not answered"
        arrays = [a.encoded() if isinstance(a, DeferredEncoding) else a for a in arrays]
        if self._use_stream(sum(a.nbytes for a in arrays)):
            req.gradients.extend(header_tensor(a) for a in arrays)
            if req.return_values:
                chunks = self._chunks(pb.PushPullStreamRequest, req, arrays)
                reader = functools.partial(_push_reader, out)
                call = Call("PushPullStream", chunks, deadline, what, reader)
                msg, values = yield from self._resending(call, group, req.seq)
                return PushResult(msg.update_count, msg.applied, msg.duplicate, values)
            chunks = self._chunks(pb.PushStreamRequest, req, arrays)
            call = Call("PushStream", chunks, deadline, what)
        else:
            for a in arrays:
                write_tensor(req.gradients.add(), a)
            call = Call("Push", _unary(req), deadline, what)
        msg = yield from self._resending(call, group, req.seq)
        values = None
        if req.return_values:
            values = _inline_values(msg.values, out)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, values)

    def _push_shared_op(
        self,
        pool: SegmentPool,
        segs: list[Segment],
        template: pb.PushRequest,
        arrays: list[Array],
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[PushResult]:
        """A push whose gradients (and returned X) travel in shared memory (in
        ``segs``, given back to ``pool`` at the end); the unary Push carries only
        their region. Resent like any push."""
        req = pb.PushRequest()
        req.CopyFrom(template)
        req.gradients.extend(header_tensor(a) for a in arrays)
        with _released(pool, segs):
            req.gradients_region.CopyFrom(segs[0].write(arrays))
            reply = segs[1] if req.return_values else None
            return (yield from self._region_push_op(req, reply, deadline, out))

    def _push_buffers_op(
        self,
        pool: SegmentPool,
        bufs: TensorBuffers,
        template: pb.PushRequest,
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[PushResult]:
        """A push of ``bufs`` (gradients written in place in their segment): the
        unary Push names their region; X, when asked for, comes back through a
        segment of ``pool``. Resent like any push."""
        req = pb.PushRequest()
        req.CopyFrom(template)
        req.gradients.extend(header_tensor(a) for a in bufs)
        with bufs.claimed() as segment:
            segs = self._segments(pool, [bufs.nbytes], 1) if req.return_values else []
            if segs is None:  # no room for the reply: X comes back inline
                segs = []
            with _released(pool, segs):
                req.gradients_region.CopyFrom(bufs.publish(segment))
                reply = segs[0] if segs else None
                return (yield from self._region_push_op(req, reply, deadline, out))

    def _region_push_op(
        self,
        req: pb.PushRequest,
        reply: Segment | None,
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[PushResult]:
        """The unary Push of a request whose gradients are named by region, resent
        like any push; X, when asked for, comes back through ``reply`` (or inline,
        without one or when the server answers inline)."""
        if reply is not None:
            req.reply_region.CopyFrom(reply.region())
        what = f"the push to group {req.group} (seq {req.seq}) was not answered"
        call = Call("Push", _unary(req), deadline, what)
        msg = yield from self._shared_call(self._resending(call, req.group, req.seq))
        values = None
        if req.return_values and reply is not None and msg.HasField("values_region"):
            values = reply.read(msg.values_region, msg.values, out=out)
        elif req.return_values:
            values = _inline_values(msg.values, out)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, values)

    def _tensor_buffers(
        self, group: str, *, timeout: float | None = None
    ) -> Op[TensorBuffers]:
        """Arrays shaped like group ``group``'s tensors X_1..X_n, in shared memory
        when this client shares it with the server (see ``TensorBuffers``): write
        gradients into them and ``push(group, *buffers)`` sends no tensor bytes;
        ``pull(group, out=buffers)`` has the server write X straight into them.
        Close them (or use ``with``) when done; the client's ``close()`` does too.
        """
        deadline = self._deadline(timeout)
        info = yield from self._describe_group(group, timeout=deadline.remaining())
        shapes = [dims for _, dims in info.tensors]
        sizes = [info.dtype.itemsize * int(np.prod(d, dtype=np.int64)) for d in shapes]
        pool = yield from self._shared_memory(sum(sizes), deadline)
        segment = None
        if pool is not None:
            try:
                segment = Segment(layout(sizes)[1], pool.directory)
            except OSError as exc:
                why = f"no room in /dev/shm for {sum(sizes)} bytes ({exc.strerror})"
                if self.shared_memory == "on":
                    raise SharedMemoryError(why) from None
                log.info("%s: these tensor buffers are not shared", why)
        bufs = TensorBuffers(group, info.dtype, shapes, segment)
        self._buffers_made.add(bufs)
        return bufs

    def _buffers_of(self, arrays: Sequence[Array]) -> TensorBuffers | None:
        """The shared TensorBuffers of this client that ``arrays`` are, if any."""
        if not arrays:
            return None
        for bufs in list(self._buffers_made):
            if bufs.shared and bufs.is_these(arrays):
                return bufs
        return None

    def _pull_into_op(
        self,
        group: str,
        min_version: int | None,
        deadline: Deadline,
        bufs: TensorBuffers,
    ) -> Op[tuple[int, list[Array]] | None]:
        """A pull of X written by the server straight into ``bufs`` (their arrays
        are the result); None when shared memory is not used for it."""
        pool = yield from self._shared_memory(bufs.nbytes, deadline)
        if pool is None:
            return None
        if min_version is not None:
            waited = f"group {group} did not reach T={min_version}"
        else:
            waited = f"the pull of group {group} was not answered"
        req = pb.PullRequest(group=group, min_version=min_version)
        with bufs.claimed() as segment:
            req.reply_region.CopyFrom(segment.region())
            call = Call("Pull", _unary(req), deadline, waited)
            msg = yield from self._shared_call(self._call_op(call))
            if msg.HasField("tensors_region") and bufs.holds(
                msg.tensors_region, msg.tensors
            ):
                return msg.update_count, list(bufs)
            if msg.HasField("tensors_region"):  # another layout: the group changed
                return msg.update_count, segment.read(msg.tensors_region, msg.tensors)
        return msg.update_count, [
            tensor_to_array(t, t.name).copy() for t in msg.tensors
        ]

    # -- the same-host transport ---------------------------------------------------
    def _shared_memory(self, nbytes: int, deadline: Deadline) -> Op[SegmentPool | None]:
        """The segments of the same-host transport when a call of ``nbytes`` should
        use it (a hello on first use), else None (bytes over gRPC)."""
        if self.shared_memory == "off" or self.shards is not None:
            return None
        if self.shared_memory == "auto" and (
            self.transport != "auto" or nbytes < SHARED_MEMORY_THRESHOLD_BYTES
        ):
            return None  # small, or a gRPC transport was asked for by name
        if self._shm_pool is not None:
            return self._shm_pool
        if self._shm_refused is not None:
            self._refuse_shared_memory(self._shm_refused)
            return None
        try:
            seg, nonce = hello_segment()
        except OSError as exc:
            why = f"cannot create a segment in /dev/shm ({exc.strerror})"
            self._refuse_shared_memory(why)
            return None
        try:
            sweep_orphans()
            req = pb.SharedMemoryHelloRequest(segment=seg.name)
            call = Call("SharedMemoryHello", _unary(req), deadline, what("the hello"))
            msg = yield call
        except RpcError as exc:
            if exc.code not in _HELLO_REFUSALS:
                raise
            self._refuse_shared_memory(f"{exc.code.name}: {exc.details}")
            return None
        finally:
            seg.close()
        if msg.nonce != nonce:
            why = "the server read another nonce: it does not share this /dev/shm"
            self._refuse_shared_memory(why)
            return None
        log.info("shared memory with %s: tensors move through /dev/shm", self.address)
        self._shm_pool = SegmentPool()
        return self._shm_pool

    def _segments(
        self, pool: SegmentPool | None, sizes: list[int], n: int
    ) -> list[Segment] | None:
        """``n`` segments of ``pool`` for one call's tensors; None (bytes over gRPC
        for this call, or SharedMemoryError with "on") when /dev/shm has no room."""
        if pool is None:
            return None
        segs: list[Segment] = []
        try:
            for _ in range(n):
                segs.append(pool.acquire(sizes))
        except OSError as exc:
            for seg in segs:
                pool.release(seg)
            why = f"no room in /dev/shm for {sum(sizes)} bytes ({exc.strerror})"
            if self.shared_memory == "on":
                raise SharedMemoryError(why) from None
            log.info("%s: this call sends its tensors over gRPC", why)
            return None
        return segs

    def _refuse_shared_memory(self, why: str) -> None:
        """Remember that the hello failed: "on" raises, "auto" falls back (once
        logged)."""
        first = self._shm_refused is None
        self._shm_refused = why
        if self.shared_memory == "on":
            raise SharedMemoryError(
                f"shared_memory='on' but the server at {self.address} cannot share "
                f"memory with this client: {why}"
            )
        if first:
            log.info(
                "shared memory with %s is not possible (%s); sending tensor bytes "
                "over gRPC",
                self.address,
                why,
            )
        return None

    def _shared_call(self, op: Op[R]) -> Op[R]:
        """``op``; when it fails because the server went away, the segments are
        unlinked (and the next call says hello again, to whatever answers then)."""
        try:
            return (yield from op)
        except (UnavailableError, DeadlineExceededError):
            self._close_shared_memory()
            raise

    def _close_shared_memory(self) -> None:
        pool, self._shm_pool = self._shm_pool, None
        if pool is not None:
            pool.close()
        if self._state is State.CLOSED:  # the client's close(): its buffers too
            for bufs in list(self._buffers_made):
                bufs.close()

    def _push(self, *args: Any, **kwargs: Any) -> Op[int | list[Array]]:
        """Push G_1..G_n (ONNX order). Returns the new T, or X_1..X_n with
        ``return_values=True`` (after the step, in sync mode)."""
        result = yield from self._push_detailed(*args, **kwargs)
        return result.update_count if result.values is None else result.values

    # push takes push_detailed's arguments: inspect.signature(push) shows them
    _push.__wrapped__ = _push_detailed  # type: ignore[attr-defined]

    # -- pull ----------------------------------------------------------------------
    def _pull(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
        out: Sequence[Array] | None = None,
    ) -> Op[list[Array]]:
        """X_1..X_n, or with ``state=True`` X..., V..., H... (ONNX output order).

        ``min_version`` waits (within the deadline) until the group's T reaches it.
        ``encoding`` ("bfloat16", "float16", "native"; None: the client's
        ``pull_encoding``) has X sent in 2 bytes per element and widened here to
        the group's dtype (X rounded to nearest even); pulls with ``state`` are
        native (the client's ``pull_encoding`` does not apply to them).
        ``out``: arrays to write the result into (the same count, shapes and
        dtype; ValueError otherwise), returned as the result. Shared
        ``tensor_buffers(group)`` as ``out`` have the server write X straight
        into them (no copy in this process); they hold this pull's X until the
        next call that writes them.
        """
        pulled = self._pull_versioned(
            group,
            state=state,
            min_version=min_version,
            encoding=encoding,
            timeout=timeout,
            out=out,
        )
        return (yield from pulled)[1]

    def _pull_versioned(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
        out: Sequence[Array] | None = None,
        allow_parts_apart: bool = False,
    ) -> Op[tuple[int, list[Array]]]:
        """(T, arrays): the tensors and the update count they belong to.

        On a cluster, T is the lowest of the parts' (with pushes in flight, parts
        can be a push apart: then the parts behind are waited for, a short while,
        and every part is at T or later); parts still at different T after that
        raise ``PartsDivergedError`` unless ``allow_parts_apart`` (X joined as the
        parts hold it, T the lowest: what ``export`` writes). ``min_version``
        waits for every part. ``out`` as for ``pull``."""
        deadline = self._deadline(timeout)
        enc = self._pull_encoding(encoding, state)
        if out is None:
            pulled = self._pull_parts(
                group, state, min_version, deadline, enc, allow_apart=allow_parts_apart
            )
            return (yield from pulled)
        bufs = self._buffers_of(list(out))
        if bufs is not None and not state and enc == "native":
            into = yield from self._pull_into_op(group, min_version, deadline, bufs)
            if into is not None:
                t, arrays = into
                return t, _written_into(out, arrays)
        pulled = self._pull_parts(
            group, state, min_version, deadline, enc, out, allow_apart=allow_parts_apart
        )
        t, arrays = yield from pulled
        return t, _written_into(out, arrays)

    def _pull_encoding(self, encoding: Any, state: bool) -> Encoding:
        if not state:
            return self._encoding(encoding, self.pull_encoding, "encoding")
        if check_encoding(encoding) != "native":
            raise ValueError(
                f"a pull with state=True travels native: encoding={encoding!r} is "
                "for X alone (pull X encoded, or the state without an encoding)"
            )
        return "native"

    def _pull_parts(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding = "native",
        out: Sequence[Array] | None = None,
        allow_apart: bool = False,
    ) -> Op[tuple[int, list[Array]]]:
        """Pull the group (a cluster client: its parts, from their shards); into
        ``out`` where its arrays fit (the caller copies into them otherwise).
        ``allow_apart``: a cluster's parts may be at different T."""
        pulled = self._pull_op(group, state, min_version, deadline, encoding, out)
        return (yield from pulled)

    def _pull_op(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding = "native",
        out: Sequence[Array] | None = None,
        shard: int = 0,
    ) -> Op[tuple[int, list[Array]]]:
        """One pull of one group (or part) from one server; a streamed or shared
        reply lands in ``out`` where its arrays fit."""
        if min_version is not None:
            waited = f"group {group} did not reach T={min_version}"
        else:
            waited = f"the pull of group {group} was not answered"
        size = self._sizes.get(group)
        unknown = group not in self._pull_segments
        if (size is None and self.transport == "auto") or (
            unknown and self.shared_memory == "on" and self.shards is None
        ):
            size = (yield from self._describe(group, deadline)).nbytes
        segment = self._pull_segments.get(group, (0, 0))[state]
        pool = None
        if encoding == "native":  # an encoded pull is asked for by name
            pool = yield from self._shared_memory(size or 0, deadline)
        segs = self._segments(pool, [segment], 1) if segment else None
        if pool is not None and segs is not None:
            shared = pb.PullRequest(
                group=group, with_state=state, min_version=min_version
            )
            pulled = self._pull_shared_op(pool, segs[0], shared, deadline, out)
            return (yield from pulled)
        wire = size or 0
        if encoding != "native":  # 2 bytes an element of X
            wire = wire // 2 if wire else 0
        ch = yield from self._data_channel_for(wire, deadline, shard)
        if ch is not None:
            got = yield from self._pull_channel_op(
                ch, group, state, min_version, deadline, out, shard, encoding
            )
            if got is not None:
                return got
        if self._use_stream(size or 0):
            req = pb.PullStreamRequest(
                group=group,
                with_state=state,
                min_version=min_version,
                encoding=ENCODING_TO_PROTO[encoding],
            )
            reader = functools.partial(_pull_reader, out)
            t, arrays = yield Call("PullStream", _unary(req), deadline, waited, reader)
            return int(t), arrays
        unary = pb.PullRequest(
            group=group,
            with_state=state,
            min_version=min_version,
            encoding=ENCODING_TO_PROTO[encoding],
        )
        msg = yield Call("Pull", _unary(unary), deadline, waited)
        return msg.update_count, [_pulled(t) for t in msg.tensors]

    def _pull_channel_op(
        self,
        ch: DataChannel,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        out: Sequence[Array] | None,
        shard: int = 0,
        encoding: Encoding = "native",
    ) -> Op[tuple[int, list[Array]] | None]:
        """A pull whose tensors come back on data channel ``ch`` (from ``shard``);
        None where the channel failed without the server saying why (pull over
        gRPC then). An encoded X is widened here, into ``out`` where it fits."""
        if min_version is not None:
            waited = f"group {group} did not reach T={min_version}"
        else:
            waited = f"the pull of group {group} was not answered"
        tid = ch.next_transfer()
        req = pb.PullRequest(
            group=group,
            with_state=state,
            min_version=min_version,
            encoding=ENCODING_TO_PROTO[encoding],
        )
        req.transfer.channel = ch.id
        req.transfer.transfer_id = tid
        into = None
        if out is not None and all(
            isinstance(o, np.ndarray) and o.flags.c_contiguous and o.flags.writeable
            for o in out
        ):
            into = list(out)
        call = Call("Pull", _unary(req), deadline, waited)
        widen = int(ENCODING_TO_PROTO[encoding])
        landing = widen if self._WIDENS_AS_IT_LANDS else 0  # 0: the A/B baseline
        if widen and not landing:
            into = None
        # without a fitting ``out``, an encoded X is widened as it lands into one
        # buffer of the group's dtype as last seen (float32 if never: any other
        # is converted after, exactly), then cut per the reply
        guess = self._dtypes.get(group, _F32) if into is None and landing else None
        try:
            msg, frame = yield Transfer(call, ch, tid, None, True, into, landing, guess)
        except (ChannelBroken, UnavailableError, FailedPreconditionError) as exc:
            if isinstance(exc, FailedPreconditionError) and (
                exc.reason not in _CHANNEL_FALLBACK_REASONS
            ):
                raise
            log.info("data channel: %s; the pull goes over gRPC", exc)
            return None
        self._data_pool(shard).give_back(ch)
        specs = [tensor_spec(t, t.name, encoded=True) for t in msg.tensors]
        if specs and not state:
            self._dtypes[group] = specs[0][0]
        if not isinstance(frame, list) and widen:
            # landed whole (an out= of other sizes, or the A/B baseline): widen now
            if frame.size % 2 or any(t.encoding != widen for t in msg.tensors):
                raise TensorFormatError(
                    f"the data channel frame of {frame.size} bytes does not hold "
                    f"the reply's X in encoding {widen}"
                )
            flat = np.empty(frame.size // 2, specs[0][0] if specs else _F32)
            widen_into(flat, frame, widen)
            return msg.update_count, _cut(flat, specs)
        if isinstance(frame, list) and guess is not None:  # widened into one buffer
            return msg.update_count, _cut(frame[0], specs)
        if isinstance(frame, list):
            if len(frame) != len(specs):
                raise ValueError(
                    f"out holds {len(frame)} arrays; the pull returned {len(specs)}"
                )
            for i, (a, (d, dims)) in enumerate(zip(frame, specs, strict=True)):
                if (a.dtype, a.shape) != (d, tuple(dims)):  # as pull(out=) says it
                    raise ValueError(
                        f"out[{i}] must be a {d} array of shape {tuple(dims)}, got "
                        f"{a.dtype} {a.shape}"
                    )
            return msg.update_count, frame
        return msg.update_count, split_frame(frame, specs)

    def _pull_shared_op(
        self,
        pool: SegmentPool,
        seg: Segment,
        req: pb.PullRequest,
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[tuple[int, list[Array]]]:
        """A pull whose tensors come back in shared memory (inline when they no
        longer fit the segment, e.g. the group was replaced)."""
        if req.HasField("min_version"):
            waited = f"group {req.group} did not reach T={req.min_version}"
        else:
            waited = f"the pull of group {req.group} was not answered"
        with _released(pool, [seg]):
            req.reply_region.CopyFrom(seg.region())
            call = Call("Pull", _unary(req), deadline, waited)
            msg = yield from self._shared_call(self._call_op(call))
            if msg.HasField("tensors_region"):
                arrays = seg.read(msg.tensors_region, msg.tensors, out=out)
                return msg.update_count, arrays
        return msg.update_count, [
            tensor_to_array(t, t.name).copy() for t in msg.tensors
        ]

    # -- rows ----------------------------------------------------------------------
    def _push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        *,
        base_version: int | None = None,
        learning_rate: float | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
    ) -> Op[PushResult]:
        """One step in which only the given rows change.

        ``gradients`` maps a tensor name to ``(indices, rows)`` (int64 (k,) and
        (k, *shape[1:])) or to a dense gradient of the whole tensor; tensors not
        named keep every row. Repeated indices are summed first. The indices and rows
        travel in ~1 MiB chunks (no size ceiling); a push the server did not answer
        (UNAVAILABLE) is resent with the same seq, and answered once. ``encoding``
        (None: the client's ``gradient_encoding``) encodes the rows as ``push``
        does; indices travel as they are."""
        deadline = self._deadline(timeout)
        enc = self._encoding(encoding, self.gradient_encoding, "encoding")
        return (
            yield from self._rows_push_op(
                group, group, gradients, base_version, learning_rate, deadline, enc
            )
        )

    def _rows_push_op(
        self,
        group: str,
        part: str,
        gradients: Mapping[str, Any],
        base_version: int | None,
        learning_rate: float | None,
        deadline: Deadline,
        encoding: Encoding = "native",
    ) -> Op[PushResult]:
        """A row push to ``part``, the name of ``group`` on the server it goes to."""
        header = pb.PushRowsHeader(
            group=part, client_id=self.client_id, seq=next(self._seq)
        )
        if base_version is not None:
            header.base_version = base_version
        if learning_rate is not None:
            header.learning_rate = learning_rate
        entries: list[tuple[str, Array | None, Array]] = []
        for name, g in gradients.items():
            if isinstance(g, tuple):
                rows = encode(g[1], encoding, f"rows of {name!r}")
                entries.append((name, _indices(g[0]), rows))
            else:
                entries.append(
                    (name, None, encode(g, encoding, f"gradient of {name!r}"))
                )
        arrays = row_gradients(header, entries)
        msg = yield from self._rows_send_op(group, header, arrays, deadline)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, None)

    def _rows_send_op(
        self,
        group: str,
        header: pb.PushRowsHeader,
        arrays: list[Array],
        deadline: Deadline,
    ) -> Op[Any]:
        """Send a row push (``row_gradients`` built it), resent while unanswered:
        the reply message."""
        what = f"the row push to group {group} (seq {header.seq}) was not answered"
        chunks = self._chunks(pb.PushRowsRequest, header, arrays)
        call = Call("PushRows", chunks, deadline, what)
        return (yield from self._resending(call, group, header.seq))

    def _pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> Op[dict[str, Array]]:
        """Rows of tensors: ``{name: indices}`` in, ``{name: rows}`` out (with
        ``state``, also ``"V:name"`` and ``"H:name"`` as the operator has them)."""
        deadline = self._deadline(timeout)
        return (
            yield from self._rows_pull_op(
                group, group, selections, state, min_version, deadline
            )
        )

    def _rows_pull_op(
        self,
        group: str,
        part: str,
        selections: Mapping[str, Any],
        state: bool,
        min_version: int | None,
        deadline: Deadline,
    ) -> Op[dict[str, Array]]:
        """A row pull from ``part``, the name of ``group`` on the server it asks."""
        header = pb.PullRowsHeader(group=part, with_state=state)
        if min_version is not None:
            header.min_version = min_version
        arrays = []
        for name, idx in selections.items():
            indices = _indices(idx)
            header.tensors.add(name=name, indices=header_tensor(indices))
            arrays.append(indices)
        chunks = self._chunks(pb.PullRowsRequest, header, arrays)
        what = f"the row pull of group {group} was not answered"
        names, rows = yield Call("PullRows", chunks, deadline, what, _rows_reader)
        return dict(zip(names, rows, strict=True))

    def _list_rows(
        self,
        group: str,
        table: str,
        *,
        page_token: str = "",
        page_size: int = 0,
        values: bool = False,
        state: bool = False,
        timeout: float | None = None,
    ) -> Op[RowsPage]:
        """A page of an ids table's ids, ascending: from the first (``page_token``
        "") or after the page whose ``next_page_token`` is given; at most
        ``page_size`` ids (0: 1000; the server may return fewer), with their X rows
        (``values``) and V, H rows (``state``)."""
        deadline = self._deadline(timeout)
        return (
            yield from self._list_rows_op(
                group, table, page_token, page_size, values, state, deadline
            )
        )

    def _list_rows_op(
        self,
        group: str,
        table: str,
        page_token: str,
        page_size: int,
        values: bool,
        state: bool,
        deadline: Deadline,
    ) -> Op[RowsPage]:
        req = pb.ListRowsRequest(
            group=group,
            table=table,
            page_token=page_token,
            page_size=page_size,
            with_values=values,
            with_state=state,
        )
        msg = yield Call("ListRows", _unary(req), deadline, what("ListRows"))
        return RowsPage(
            tensor_to_array(msg.ids, "ids").copy(),
            {t.name: tensor_to_array(t, t.name).copy() for t in msg.rows},
            msg.next_page_token,
            int(msg.row_count),
            int(msg.update_count),
        )

    def _count_rows(
        self, group: str, table: str, *, timeout: float | None = None
    ) -> Op[int]:
        """Rows an ids table holds."""
        info = yield from self._describe_group(group, timeout=timeout)
        if table not in info.tables:
            held = ", ".join(info.tables) or "none"
            raise ValueError(
                f"group {group!r} has no ids table {table!r}; its ids tables: {held}"
            )
        return info.tables[table].row_count

    def _export_rows(
        self,
        group: str,
        table: str,
        *,
        state: bool = False,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> Op[tuple[Array, dict[str, Array]]]:
        """Every id of an ids table ascending and its rows (X, and V, H with
        ``state``), read page by page (each page under ``timeout``)."""
        pages: list[RowsPage] = []
        token = ""
        while True:
            page = yield from self._list_rows(
                group,
                table,
                page_token=token,
                page_size=page_size,
                values=True,
                state=state,
                timeout=timeout,
            )
            pages.append(page)
            token = page.next_page_token
            if not token:
                break
        ids = np.concatenate([p.ids for p in pages])
        rows = {k: np.concatenate([p.rows[k] for p in pages]) for k in pages[0].rows}
        return ids, rows

    def _resending(self, call: Call, group: str, seq: int) -> Op[Any]:
        """Send a push, and resend it (same seq) while the server is unavailable,
        until the deadline: the server answers a repeat with its first result."""
        backoff = 0.1
        unavailable: RpcError | None = None
        while True:
            try:
                return (yield call)
            except DeadlineExceededError:
                if unavailable is None:
                    raise
                raise self._gone(group, seq, call.deadline, unavailable) from None
            except RpcError as exc:
                if exc.code not in _RESEND_CODES:
                    raise
                unavailable = exc
            pause = min(backoff, call.deadline.remaining())
            if pause <= 0:
                raise self._gone(group, seq, call.deadline, unavailable)
            log.info(
                "push to %s seq %d: %s; resending in %.1f s",
                group,
                seq,
                unavailable.code.name,
                pause,
            )
            yield Pause(pause)
            backoff = min(_RESEND_BACKOFF_MAX, backoff * 2)

    def _gone(
        self, group: str, seq: int, deadline: Deadline, last: RpcError
    ) -> UnavailableError:
        return UnavailableError(
            f"the server at {self.address} stayed unavailable for "
            f"{deadline.seconds:g} s ({last.details}); the push to group "
            f"{group} (seq {seq}) may not have been applied",
            reason=last.reason,  # the last refusal's details (e.g. WAL_WRITE_FAILED)
            metadata=last.metadata,
            violations=last.violations,
        )

    # -- apply ---------------------------------------------------------------------
    def _apply(
        self, optimizer: OptimizerSpec, *inputs: Any, timeout: float | None = None
    ) -> Op[list[Array]]:
        """Run one ONNX node remotely: ``R, T, X..., G..., V..., H...`` in,
        ``X_new..., V_new..., H_new...`` out."""
        arrays = [np.asarray(a) for a in inputs]
        if len(arrays) >= 2 and arrays[1].dtype.kind in "iu":
            arrays[1] = arrays[1].astype(np.int64)
        deadline = self._deadline(timeout)
        optimizer = _spec(optimizer, "optimizer", OptimizerSpec)
        req = pb.ApplyRequest(optimizer=optimizer.to_proto())
        if self._use_stream(sum(a.nbytes for a in arrays)):
            req.inputs.extend(header_tensor(a) for a in arrays)
            chunks = self._chunks(pb.ApplyStreamRequest, req, arrays)
            waited = what("ApplyStream")
            _, outputs = yield Call(
                "ApplyStream", chunks, deadline, waited, _apply_reader
            )
            return list(outputs)
        for a in arrays:
            write_tensor(req.inputs.add(), a)
        msg = yield Call("Apply", _unary(req), deadline, what("Apply"))
        return [
            tensor_to_array(t, f"output {i}").copy() for i, t in enumerate(msg.outputs)
        ]

    # -- workers and durability ----------------------------------------------------
    def _join_op(
        self, group: str, worker_id: str, timeout: float | None
    ) -> Op[LeaseInfo]:
        req = pb.JoinGroupRequest(group=group, worker_id=worker_id)
        return lease_info((yield from self._unary_op("JoinGroup", req, timeout)))

    def _heartbeat_op(self, group: str, worker_id: str, interval: float) -> Op[Any]:
        req = pb.HeartbeatRequest(group=group, worker_id=worker_id)
        timeout = min(interval * 2, self.timeout)
        return (yield from self._unary_op("Heartbeat", req, timeout))

    def _heartbeat_interval(self, lease: LeaseInfo) -> float:
        return max(0.05, lease.lease_seconds / 3)

    def _leave_op(
        self, group: str, worker_id: str, timeout: float | None
    ) -> Op[LeaseInfo]:
        req = pb.LeaveGroupRequest(group=group, worker_id=worker_id)
        return lease_info((yield from self._unary_op("LeaveGroup", req, timeout)))

    def _save(self, *, timeout: float | None = None) -> Op[SaveInfo]:
        """Ask the server to write a snapshot of every group now."""
        msg = yield from self._unary_op("Save", pb.SaveRequest(), timeout)
        return SaveInfo(msg.path, msg.groups, msg.bytes)

    def _export(self, path: str | os.PathLike[str], prefix: str = "") -> Op[list[str]]:
        """Write every group whose name starts with ``prefix`` (tensors, optimizer
        state, T, learning rate) to one .npz file; returns the group names."""
        return export_op(self, path, prefix)

    def _import_(
        self,
        path: str | os.PathLike[str],
        *,
        existing: Literal["fail", "skip", "replace"] = "fail",
    ) -> Op[list[str]]:
        """Create the groups of a file written by ``export``; returns their names.

        The file is checked whole first. A group the server already has makes the
        import fail before anything is created (``existing="fail"``), is left as it
        is (``"skip"``, not in the result) or is replaced by the file's.
        """
        return (yield from import_op(self, path, existing=existing)).imported


def _cut(
    flat: Array, specs: Sequence[tuple[np.dtype[Any], Sequence[int]]]
) -> list[Array]:
    """Views of the widened values in ``flat`` per ``specs`` (converted, exactly,
    where the group's dtype is not ``flat``'s)."""
    arrays = []
    at = 0
    for dtype, dims in specs:
        count = math.prod(dims)
        piece = flat[at : at + count].reshape(tuple(dims))
        arrays.append(piece if piece.dtype == dtype else piece.astype(dtype))
        at += count
    if at != flat.size:
        raise TensorFormatError(
            f"the data channel frame holds {flat.size} elements; the reply's "
            f"tensors declare {at}"
        )
    return arrays


def _written_into(out: Sequence[Array], arrays: Sequence[Array]) -> list[Array]:
    """``out``, holding ``arrays`` (the very arrays when they already are)."""
    out = list(out)
    if len(out) != len(arrays):
        raise ValueError(
            f"out holds {len(out)} arrays; the pull returned {len(arrays)}"
        )
    for i, (o, a) in enumerate(zip(out, arrays, strict=True)):
        if not isinstance(o, np.ndarray) or o.shape != a.shape or o.dtype != a.dtype:
            got = f"{o.dtype} {o.shape}" if isinstance(o, np.ndarray) else type(o)
            raise ValueError(
                f"out[{i}] must be a {a.dtype} array of shape {a.shape}, got {got}"
            )
        if o is not a:
            np.copyto(o, a)
    return out


def _reply_arrays(
    out: Any, gradients: Sequence[Any], return_values: bool
) -> list[Array]:
    """A push's ``out``, checked before anything is sent: one writable array per
    gradient, of its shape and dtype (X has the gradient's shape and the group's
    dtype, which a pushed gradient has too)."""
    if not return_values:
        raise ValueError("out= receives X: it needs return_values=True")
    if isinstance(out, np.ndarray):
        raise TypeError("out is a sequence of arrays (one per gradient), not an array")
    arrays = list(out)
    if len(arrays) != len(gradients):
        raise ValueError(
            f"out holds {len(arrays)} arrays for {len(gradients)} gradients: X "
            "comes back as one array per gradient"
        )
    for i, (o, g) in enumerate(zip(arrays, gradients, strict=True)):
        want = np.asarray(g)
        if (
            not isinstance(o, np.ndarray)
            or o.shape != want.shape
            or o.dtype != want.dtype
            or not o.flags.writeable
        ):
            got = (
                f"{'' if o.flags.writeable else 'read-only '}{o.dtype} {o.shape}"
                if isinstance(o, np.ndarray)
                else type(o).__name__
            )
            raise ValueError(
                f"out[{i}] must be a writable {want.dtype} array of shape "
                f"{want.shape} (gradient {i + 1}'s), got {got}"
            )
        if any(np.may_share_memory(o, g) for g in gradients):
            # A resend reads the gradients again, after X may have landed in out.
            raise ValueError(
                f"out[{i}] shares memory with a gradient: X needs arrays of its own"
            )
    return arrays


def _inline_values(
    tensors: Sequence[pb.Tensor], out: Sequence[Array] | None
) -> list[Array]:
    """X carried inline in a reply: copied once, into ``out`` where it fits."""
    views = [tensor_to_array(t, t.name) for t in tensors]
    if out is not None and len(out) == len(views):
        fits = all(
            o.shape == v.shape and o.dtype == v.dtype
            for o, v in zip(out, views, strict=True)
        )
        if fits:
            return _written_into(out, views)
    return [v.copy() for v in views]


@contextlib.contextmanager
def _released(pool: SegmentPool, segs: list[Segment]) -> Iterator[None]:
    """Give a call's segments back to ``pool`` when it ends, however it ends."""
    try:
        yield
    finally:
        for seg in segs:
            pool.release(seg)


def _table_specs(
    tables: Mapping[str, IdsTable],
    table_rows: Sequence[Sequence[Any]] | None,
    arrays: Sequence[Array],
) -> tuple[list[pb.IdsTableSpec], list[list[Array]]]:
    """The IdsTableSpec messages of ``tables`` and their rows (for import)."""
    specs = []
    for name, t in tables.items():
        if not isinstance(t, IdsTable):
            raise TypeError(
                f"tables[{name!r}] must be an IdsTable(dim, ...), got {t!r}"
            )
        if t.dtype is not None and arrays and np.dtype(t.dtype) != arrays[0].dtype:
            raise ValueError(
                f"ids table {name!r} is {np.dtype(t.dtype)}, the group's tensors "
                f"{arrays[0].dtype}: a group has one dtype"
            )
        specs.append(
            pb.IdsTableSpec(
                name=name,
                dim=t.dim,
                initializer=initializer_to_proto(t.initializer),
                max_rows=t.max_rows,
            )
        )
    rows = [[np.asarray(a) for a in r] for r in table_rows or ()]
    if rows and len(rows) != len(specs):
        raise ValueError(
            f"table_rows has {len(rows)} entries for {len(specs)} ids tables"
        )
    return specs, rows


def _tcp_host(address: str) -> str | None:
    """The host of a ``host:port`` address (None for unix: and other schemes)."""
    if "/" in address or address.startswith(("unix:", "unix-abstract:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def what(method: str) -> str:
    return f"{method} was not answered"


def _pulled(t: pb.Tensor) -> Array:
    """A pulled tensor as an array of its own (an encoded one is widened already)."""
    a = tensor_to_array(t, t.name, encoded=True)
    return a.copy() if t.encoding == pb.ENCODING_UNSPECIFIED else a


def _pull_reader(out: Sequence[Array] | None = None) -> StreamReader:
    def header(m: pb.PullStreamResponse) -> tuple[int, list[pb.Tensor], list[str]]:
        tensors = list(m.header.tensors)
        return m.header.update_count, tensors, [t.name for t in tensors]

    return _TensorStreamReader(header, encoded=True, out=out)


def _push_reader(out: Sequence[Array] | None = None) -> StreamReader:
    def header(
        m: pb.PushPullStreamResponse,
    ) -> tuple[pb.PushResponse, list[pb.Tensor], list[str]]:
        values = list(m.header.values)
        return m.header, values, [t.name for t in values]

    return _TensorStreamReader(header, out=out)


def _rows_reader() -> StreamReader:
    def header(m: pb.PullRowsResponse) -> tuple[list[str], list[pb.Tensor], list[str]]:
        rows = list(m.header.rows)
        names = [t.name for t in rows]
        return names, rows, names

    return _TensorStreamReader(header)


def row_gradients(
    header: pb.PushRowsHeader, entries: Sequence[tuple[str, Array | None, Array]]
) -> list[Array]:
    """Declare ``(name, indices or None for a dense gradient, values)`` in a row
    push's header; the arrays whose bytes follow it, in order."""
    arrays: list[Array] = []
    for name, indices, values in entries:
        gr = header.gradients.add(name=name)
        if indices is not None:
            gr.indices.CopyFrom(header_tensor(indices))
            arrays.append(indices)
        gr.values.CopyFrom(header_tensor(values))
        arrays.append(values)
    return arrays


def _indices(idx: Any) -> Array:
    """Row indices as given, integers widened to int64 (the wire's)."""
    indices = np.asarray(idx)
    if indices.dtype.kind in "iu":
        indices = indices.astype(np.int64, copy=False)
    return indices


def _apply_reader() -> StreamReader:
    def header(m: pb.ApplyStreamResponse) -> tuple[None, list[pb.Tensor], list[str]]:
        outputs = list(m.response.outputs)
        return None, outputs, [f"output {i}" for i in range(len(outputs))]

    return _TensorStreamReader(header)
