"""What both clients do, written once: requests, replies, transports, deadlines, errors.

Every call is an *operation*: a generator that builds its requests, yields the
effects it needs (``Call``: one RPC; ``Pause``: wait before a resend; ``Parallel``:
run several operations at once, e.g. one per shard of a cluster) and returns the
decoded reply. ``Client`` performs the effects with blocking grpc calls (and a
thread pool) and ``AsyncClient`` with ``grpc.aio`` coroutines (and tasks); neither
knows anything about a request or a reply. Operations compose with ``yield from``.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NoReturn, TypeVar

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    CHUNK_BYTES,
    DTYPE_TO_PROTO,
    SHARD_METADATA_KEY,
    header_tensor,
    tensor_to_array,
    write_tensor,
)
from onnxps.wire.encoding import (
    DeferredEncoding,
    Encoding,
    check_encoding,
    encode,
)
from onnxps.wire.initializers import IdsTable
from onnxps.wire.weights import file_format

from ._channel_transport import DataChannelLink, DataChannelMode
from ._discovery import CoordinatorTls, Discovery, is_coordinator
from ._errors import ClientClosedError, RpcError
from ._following import FollowsPlacement
from ._frames import CallChannel
from ._gradients import gradient_arrays, native_arrays
from ._grpc_transport import Transport
from ._ops import (
    Call,
    Deadline,
    Effect,
    Op,
    OpRun,
    Parallel,
    Pause,
    PushCall,
    as_method,
    on_shard,
    parallel,
    unary_call,
    unary_request,
    what,
)
from ._optimizers import Async, OptimizerSpec, Sync
from ._pending import PendingPushes
from ._records import (
    GroupInfo,
    HistoryInfo,
    LeaseInfo,
    PushResult,
    RewindInfo,
    RowsPage,
    SaveInfo,
)
from ._replies import (
    apply_reader,
    reply_arrays,
    row_gradients,
    table_specs,
    written_into,
)
from ._routes import Route, Targets, route_of
from ._settings import (
    channel_credentials,
    channel_options,
    check_client_arguments,
    multicallable,
    named_tensors,
    spec,
    with_default_port,
)
from ._shardops import ShardOps
from ._shm_transport import SharedMemoryLink
from ._transfer import export_op, import_op
from ._transport import Transports
from ._weights import export_weights_op, import_weights_op
from .shm import (
    SharedMemoryMode,
    TensorBuffers,
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
R = TypeVar("R")

STREAM_THRESHOLD_BYTES = 1 << 20
SPLIT_BYTES = 64 << 20  # a cluster splits a group whose X is larger


class State(enum.Enum):
    UNOPENED = 1
    OPEN = 2
    CLOSED = 3


class ClientCore(FollowsPlacement):
    """Settings and per-client state both clients share, and every operation."""

    # Whether this client performs ``Transfer`` (data channel) effects.
    TRANSFERS = True

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
        frames: Literal["auto", "on", "off"] = "auto",
        coordinator_ca: str | None = None,
        coordinator_cert: str | None = None,
        coordinator_key: str | None = None,
        **unexpected: NoReturn,
    ) -> None:
        # A replicated cluster (docs/cluster.md): its primaries from etcd, over TLS
        # for etcds:// with these files (none given: ONNXPS_COORDINATOR_*'s).
        self._discovery = None
        etcd_tls = CoordinatorTls(coordinator_ca, coordinator_cert, coordinator_key)
        named = etcd_tls != CoordinatorTls()
        if isinstance(address, str) and is_coordinator(address):
            self._discovery = Discovery(address, tls=etcd_tls if named else None)
            address = self._discovery.addresses(timeout)
            self._placement = self._discovery.placement_within(timeout)
        elif named:
            raise ValueError(
                "coordinator_ca, coordinator_cert and coordinator_key are the files "
                f"of an etcds:// address, not of {address!r}"
            )
        check_client_arguments(
            type(self).__name__,
            address,
            timeout,
            transport,
            chunk_bytes,
            root_certificates,
            unexpected,
            shared_memory,
            data_channel,
            frames,
        )
        # Small Push and Pull calls as frames on a call channel beside gRPC, where
        # the server offers a data port ("auto" and "on"; "off": gRPC); on a
        # replicated cluster, a channel to a server that is no longer the primary
        # is dropped and its call follows over gRPC (``CallChannelLink``)
        self.frames = frames != "off"
        # A list of addresses is a cluster: shard i at addresses[i] (docs/cluster.md,
        # "A cluster of shards").
        # "host" alone means port 50051, the one ``onnxps serve`` listens on.
        given = [address] if isinstance(address, str) else list(address)
        self.addresses = [with_default_port(a) for a in given]
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
        # How gradients and pulled X travel unless a call says (docs/transports.md,
        # "Compressed gradients on the wire"): None is native.
        self.gradient_encoding = check_encoding(gradient_encoding, "gradient_encoding")
        self.pull_encoding = check_encoding(pull_encoding, "pull_encoding")
        self._token = token
        self._tls = (root_certificates, private_key, certificate_chain)
        self._server_name_override = server_name_override
        # The same-host transport: "auto" (with transport="auto") tries it for
        # calls of at least SHARED_MEMORY_THRESHOLD_BYTES and falls back to bytes
        # where the hello is refused; "on" uses it for every push and pull and
        # raises SharedMemoryError where it cannot work; "off" never uses it.
        self.shared_memory: SharedMemoryMode = shared_memory
        # The data channel (docs/transports.md, "The data channel"): "auto" (with
        # transport="auto") carries the bytes of native calls of at least
        # DATA_CHANNEL_THRESHOLD_BYTES on sockets beside gRPC when the server
        # offers them, "on" every push and pull (DataChannelError where it cannot),
        # "off" never. Shared memory, where it works, goes first.
        self.data_channel: DataChannelMode = data_channel
        if self._discovery is not None and self.shared_memory == "auto":
            # A segment is bound to one server's host: a replicated cluster's
            # primaries move (docs/cluster.md "Replicated shards"). A data channel
            # is opened again to the new primary (``DataChannelLink``).
            self.shared_memory = "off"
        # The transport seam (``_transport``): the ways of every call, and their
        # links per server (a cluster: per shard, each with its own hello and
        # segments)
        self._transports = Transports(
            self, self._tls, server_name_override, {}, self._discovery is not None
        )
        self._shm_link = self._transports.shm(0)
        self._data_link: DataChannelLink = self._transports.channels
        self._state = State.UNOPENED
        # One call of a group (or part) to one server, and what calls remember of
        # groups (sizes, dtypes, a cluster's layouts, pushes not all landed)
        self.ops = ShardOps(self, self._transports)
        # Where each call goes: the one server, or its group's parts (``_routes``)
        self._route: Route = route_of(self.ops)
        # each shard's call metadata (token, shard identity), made once
        self._metadatas = [self._metadata(s) for s in range(len(self.addresses))]
        self._setup()

    @property
    def _shm_links(self) -> dict[int, SharedMemoryLink]:
        """The shared-memory links, per shard that was asked for one."""
        return self._transports.shm_links

    @property
    def _seq(self) -> itertools.count[int]:
        """The seqs of this client's pushes (``ShardOps.seq``)."""
        return self.ops.seq

    @_seq.setter
    def _seq(self, seq: itertools.count[int]) -> None:
        self.ops.seq = seq

    @property
    def _pending(self) -> PendingPushes:
        """The pushes whose parts did not all land, per group (``ShardOps``)."""
        return self.ops.pending

    @property
    def _call_channels(self) -> dict[int, CallChannel]:
        """The open call channels, per shard (``frames="on"``)."""
        return self._transports.call_channels

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

    def _unary_op(self, method: str, request: Any, timeout: float | None) -> Op[Any]:
        return unary_call(method, request, self._deadline(timeout))

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
        items = named_tensors(tensors or {})
        arrays = [np.asarray(a) for _, a in items]
        state_arrays = [np.asarray(a) for a in state or ()]
        specs, table_arrays = table_specs(tables or {}, table_rows, arrays)
        req = pb.CreateGroupRequest(
            group=name,
            optimizer=spec(optimizer, "optimizer", OptimizerSpec).to_proto(),
            learning_rate=learning_rate,
            consistency=spec(consistency or Async(), "consistency").to_proto(),
            allow_non_finite=allow_non_finite,
            update_count=update_count,
            lease_seconds=lease_seconds or 0.0,
            tables=specs,
            # the same in every resend (and every part): answered exactly once
            request_id=uuid.uuid4().hex,
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
        return self._route.create(
            req, names, arrays, state_arrays, deadline, table_arrays
        )

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        return self._route.describe(name, self._deadline(timeout))

    def _list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> Op[list[GroupInfo]]:
        return self._route.list_groups(prefix, self._deadline(timeout))

    def _delete_group(self, name: str, *, timeout: float | None = None) -> Op[bool]:
        self.ops.sizes.pop(name, None)
        return self._route.delete(name, self._deadline(timeout))

    def _set_learning_rate(
        self, name: str, learning_rate: float, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        deadline = self._deadline(timeout)
        return self._route.set_learning_rate(name, learning_rate, deadline)

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
        # Built now, not when first stepped (this is no generator: the op it
        # returns is ``_push_sent``): its deadline and seq start with the call, and
        # bad arguments raise here, before anything is sent.
        deadline = self._deadline(timeout)
        enc = self._encoding(encoding, self.gradient_encoding, "encoding")
        dtype = self.ops.dtypes.get(group)
        grads: Sequence[Any]
        if enc == "native":  # the common case: one pass over the gradients
            grads = native_arrays(gradients, dtype)
        else:
            grads = gradient_arrays(gradients, dtype)
        if out is not None:
            out = reply_arrays(out, grads, return_values)
        if enc != "native" and self._defers_encoding():
            # encoded block by block as the data channel sends it, or all at once
            # (``_push_op``) if the push goes another way
            arrays: list[Any] = [
                DeferredEncoding(g, enc, f"gradient {i + 1}")
                for i, g in enumerate(grads)
            ]
        elif enc == "native":
            arrays = list(grads)  # arrays already, as ``encode`` gives them
        else:
            arrays = [encode(g, enc, f"gradient {i + 1}") for i, g in enumerate(grads)]
        req = pb.PushRequest(
            group=group,
            client_id=self.client_id,
            seq=next(self.ops.seq),
            return_values=return_values,
        )
        if base_version is not None:
            req.base_version = base_version
        if learning_rate is not None:
            req.learning_rate = learning_rate
        # on the one server, or its parts on the shards of a cluster
        return self._push_sent(req, arrays, deadline, out)

    def _push_sent(
        self,
        req: pb.PushRequest,
        arrays: list[Any],
        deadline: Deadline,
        out: Sequence[Any] | None,
    ) -> Op[PushResult]:
        """The push ``_push_detailed`` built, sent (the part run when stepped)."""
        result = yield from self._route.push(req, arrays, deadline, out)
        if out is None or result.values is None:
            return result
        return dataclasses.replace(result, values=written_into(out, result.values))

    def _defers_encoding(self) -> bool:
        """Whether an encoded push may leave its encoding to the data channel's
        sending (a single server that may give a channel)."""
        return self.TRANSFERS and self.data_channel != "off" and self.shards is None

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
        shapes = [tuple(dims) for _, dims in info.tensors]
        made = self._shm_link.make_buffers(group, info.dtype, shapes, deadline)
        return (yield from made)

    def _close_transports(self) -> None:
        """Close the data channels and unlink the segments (the client's close():
        its tensor buffers too)."""
        self._transports.close(closing_client=self._state is State.CLOSED)

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
        pulled = self._pull_parts(
            group, state, min_version, deadline, enc, out, allow_apart=allow_parts_apart
        )
        t, arrays = yield from pulled
        return t, written_into(out, arrays)

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
        return self._route.pull(
            group, state, min_version, deadline, encoding, out, allow_apart
        )

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
        return self._route.push_rows(
            group, gradients, base_version, learning_rate, deadline, enc
        )

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
        return self._route.pull_rows(group, selections, state, min_version, deadline)

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
        return self._route.list_rows(
            group, table, page_token, page_size, values, state, deadline
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
        optimizer = spec(optimizer, "optimizer", OptimizerSpec)
        req = pb.ApplyRequest(optimizer=optimizer.to_proto())
        nbytes = sum(a.nbytes for a in arrays)
        if self._transports.streams("apply", nbytes, len(arrays)):
            req.inputs.extend(header_tensor(a) for a in arrays)
            chunks = self.ops.chunks(pb.ApplyStreamRequest, req, arrays)
            waited = what("ApplyStream")
            _, outputs = yield Call(
                "ApplyStream", chunks, deadline, waited, apply_reader
            )
            return list(outputs)
        for a in arrays:
            write_tensor(req.inputs.add(), a)
        msg = yield Call("Apply", unary_request(req), deadline, what("Apply"))
        return [
            tensor_to_array(t, f"output {i}").copy() for i, t in enumerate(msg.outputs)
        ]

    # -- workers and durability ----------------------------------------------------
    def _heartbeat_op(self, group: str, worker_id: str, interval: float) -> Op[Any]:
        req = pb.HeartbeatRequest(group=group, worker_id=worker_id)
        timeout = min(interval * 2, self.timeout)
        return (yield from self._unary_op("Heartbeat", req, timeout))

    def _heartbeat_interval(self, lease: LeaseInfo) -> float:
        return max(0.05, lease.lease_seconds / 3)

    def _rewind(
        self, group: str, *, to_step: int, timeout: float | None = None
    ) -> Op[RewindInfo]:
        """Set ``group`` back to its state right after step ``to_step``: X, V, H,
        ids tables' rows and T bit for bit as they were then (on a cluster, every
        part). Needs a server with ``--durability wal``; the learning rate and
        settings stay as they are now. Pushes computed before the rewind are
        refused (``REWOUND``): pull after it. ``FailedPreconditionError`` with
        reason ``STEP_NOT_RETAINED`` when the step is older than retention keeps
        (its details name ``oldest_step``)."""
        if isinstance(to_step, bool) or not isinstance(to_step, int) or to_step < 0:
            raise ValueError(f"to_step must be an int >= 0, got {to_step!r}")
        return self._route.rewind(group, to_step, self._deadline(timeout))

    def _fork(
        self,
        group: str,
        new_group: str,
        *,
        at_step: int,
        timeout: float | None = None,
    ) -> Op[RewindInfo]:
        """Create ``new_group`` with ``group``'s state right after step ``at_step``
        (X, V, H, ids tables' rows, T, and the learning rate of that step); the
        two groups go on apart. Needs ``--durability wal`` (one server)."""
        if isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0:
            raise ValueError(f"at_step must be an int >= 0, got {at_step!r}")
        return self._route.fork(group, new_group, at_step, self._deadline(timeout))

    def _history(self, group: str, *, timeout: float | None = None) -> Op[HistoryInfo]:
        """The steps ``group`` can go back to (``rewind``, ``fork``), oldest first,
        with their times, and the disk the server's retention holds."""
        return self._route.history(group, self._deadline(timeout))

    def _save(self, *, timeout: float | None = None) -> Op[SaveInfo]:
        """Ask the server (every shard of a cluster) to write a snapshot of every
        group now; a cluster's paths are joined with ", " in shard order."""
        return self._route.save(self._deadline(timeout))

    def _join_parts(
        self, group: str, worker_id: str, timeout: float | None
    ) -> Op[tuple[Targets, LeaseInfo]]:
        """Join every part of a group: its parts, and the lease as the first part
        answered it."""
        return self._route.join(group, worker_id, self._deadline(timeout))

    def _leave_parts(
        self, group: str, worker_id: str, timeout: float | None
    ) -> Op[LeaseInfo]:
        """Leave every part of a group; the lease as the first part answered."""
        return self._route.leave(group, worker_id, self._deadline(timeout))

    def _heartbeats_op(
        self, targets: Targets, worker_id: str, interval: float
    ) -> Op[None]:
        """One heartbeat to each part, in turn; a failed one is logged (the next
        beat tries again). Raises ClientClosedError once the client is closed."""
        for shard, name in targets:
            beat = self._heartbeat_op(name, worker_id, interval)
            try:
                yield from on_shard(shard, beat)
            except RpcError as exc:
                log.warning("heartbeat for %s in %s failed: %s", worker_id, name, exc)

    def _drop_pending(self) -> None:
        """The client closes: the pushes whose parts did not all land stay apart on
        the parts that missed them (docs/cluster.md, "When the parts of a split
        group disagree"); said once per push."""
        for entry in self.ops.pending.every():
            log.warning(
                "closing the client with push seq %d to %s not landed on %s (%s): "
                "the other parts took it (or may have), and stay a push ahead",
                entry.seq,
                entry.group,
                ", ".join(str(p[1].group) for p in entry.parts),
                entry.why,
            )
            self.ops.pending.replace(entry, None)

    def _export(
        self,
        path: str | os.PathLike[str],
        prefix: str = "",
        *,
        group: str | None = None,
        model: str | os.PathLike[str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Op[list[str]]:
        """Write groups to a file whose format follows its extension; returns the
        names of the groups written: every group whose name starts with
        ``prefix``, or the one named ``group``.

        - ``.safetensors``: the groups' tensors X by name (a split group's parts
          joined), for a model loader (``safetensors``, ``load_state_dict``).
        - ``.onnx``: the tensors written into a copy of the ONNX ``model``, whose
          initializers they are (same names, dtypes and shapes); every other byte
          of the copy is the model's.
        - any other name (``.npz``): tensors, optimizer state, T and learning
          rate, for ``import_``.

        ``progress(done, total)`` is called as bytes are pulled and written
        (.safetensors, .onnx).
        """
        if file_format(path) == "npz":
            if model is not None:
                raise ValueError("model= names the ONNX model of an .onnx export")
            return (yield from export_op(self, path, prefix, group))
        weights = export_weights_op(
            self, path, group=group, prefix=prefix, model=model, progress=progress
        )
        return (yield from weights).groups

    def _import_(
        self,
        path: str | os.PathLike[str],
        *,
        existing: Literal["fail", "skip", "replace"] = "fail",
        group: str | None = None,
        optimizer: OptimizerSpec | None = None,
        learning_rate: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Op[list[str]]:
        """Create groups from a file; returns their names. The format follows the
        extension, as for ``export``; ``group`` imports only that group of the
        file (.safetensors, .onnx of a model: the group to create, by default the
        file's name without its extension).

        An ``.npz`` file is checked whole first. A group the server already has
        makes the import fail before anything is created (``existing="fail"``), is
        left as it is (``"skip"``, not in the result) or is replaced by the file's.

        A ``.safetensors`` or ``.onnx`` file's float32/float64 tensors (integers
        and booleans are left out) become a group with ``optimizer`` and
        ``learning_rate`` (for a file ``export`` wrote: by default those it
        names). A group the server already has takes the file's values if its
        tensors have the same names, shapes and dtype (its optimizer state, T and
        settings kept; it is created again, so a worker that joined it must join
        again), and the import is refused otherwise, before anything changes.
        """
        if file_format(path) == "npz":
            if optimizer is not None or learning_rate is not None:
                raise ValueError(
                    "an .npz export says how its groups are trained: optimizer= "
                    "and learning_rate= are for .safetensors and .onnx files"
                )
            result = yield from import_op(self, path, existing=existing, group=group)
            return result.imported
        if existing != "fail":
            raise ValueError(
                "existing= is for .npz files: a .safetensors or .onnx import writes "
                "into a group the server has (same tensors) or refuses"
            )
        weights = import_weights_op(
            self,
            path,
            group=group,
            optimizer=optimizer,
            learning_rate=learning_rate,
            progress=progress,
        )
        return (yield from weights).imported
