"""The operations of one shard (or of the one server): what the routes and the
cluster's modules (``_routes``, ``_sharded``, ``_rowsplit``, ``_ids_cluster``) call,
through this public interface, never the client core's insides.

``ShardOps`` sends one call of one group (or of one part of a split group) to one
server: create, describe, push, pull, the row calls, a page of an ids table. It
keeps what those calls learn and share across calls: each group's size, dtype and
pull segments as last seen (``remember``), a cluster's layouts of its groups'
parts, and the pushes whose parts did not all land (``pending``). The client core
makes one and hands it to its route; both clients' operations use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import header_tensor, tensor_to_array, write_tensor
from onnxps.wire.encoding import ENCODING_TO_PROTO, Encoding, encode
from onnxps.wire.shm import layout

from ._cluster import Layout
from ._errors import RpcError
from ._flatform import FlatForm, is_layout_mismatch, pays
from ._grpc_transport import Transport, chunk_stream, resending
from ._ops import Call, Deadline, Op, unary_request, what
from ._pending import PendingPushes
from ._records import GroupInfo, PushResult, RowsPage, group_info
from ._replies import as_indices, row_gradients, rows_reader
from ._transport import CallShape, Transports
from .shm import SharedMemoryMode

__all__ = ["ShardHost", "ShardOps"]

Array = np.ndarray[Any, Any]


class ShardHost(Protocol):
    """The client settings the operations read, live (all public)."""

    address: str
    addresses: list[str]
    client_id: str
    shards: int | None
    split_bytes: int
    transport: Transport
    shared_memory: SharedMemoryMode
    chunk_bytes: int

    @property
    def placement_shards(self) -> int | None: ...

    def owner(self, name: str) -> int | None: ...

    def refresh_placement(self) -> None: ...


class ShardOps:
    """One call of one group (or part) to one server, and what calls remember."""

    def __init__(self, host: ShardHost, transports: Transports) -> None:
        self.host = host
        self.transports = transports
        # Seqs start at the wall clock in microseconds, not 1: a worker restarted
        # with the same client_id must not repeat seqs the server remembers, or its
        # first pushes would be answered as duplicates and silently dropped.
        self.seq = itertools.count(time.time_ns() // 1000)
        self.sizes: dict[str, int] = {}
        # each group's dtype as last seen (shared with the data channels: an
        # encoded pull widens into it)
        self.dtypes = transports.channels.dtypes
        # group -> segment bytes its pull needs without and with state
        self.pull_segments: dict[str, tuple[int, int]] = {}
        # A cluster client's layouts of its groups' parts, and per group the
        # pushes whose parts did not all land (sent first by its next push or pull)
        self.layouts: dict[str, Layout] = {}
        self.pending = PendingPushes()
        # part name -> the shard a MOVED answer named (a resharding moved it)
        self.moved: dict[str, int] = {}
        # group -> its flat form (``_flatform``), as create and describe said
        self.flat_forms: dict[str, FlatForm] = {}

    @property
    def shards(self) -> int | None:
        return self.host.shards

    @property
    def placement_shards(self) -> int:
        """New groups are placed over this many shards (docs/resharding.md)."""
        return self.host.placement_shards or self.host.shards or 1

    def shard_of(self, name: str, shard: int) -> int:
        """Where a call of ``name`` (a group or part) goes: the shard a MOVED
        answer named, else the placement map's owner, else ``shard``."""
        moved = self.moved.get(name)
        if moved is not None:
            return moved
        owner = self.host.owner(name)
        return shard if owner is None else owner

    @property
    def split_bytes(self) -> int:
        return self.host.split_bytes

    @property
    def addresses(self) -> list[str]:
        return self.host.addresses

    @property
    def client_id(self) -> str:
        return self.host.client_id

    def next_seq(self) -> int:
        return next(self.seq)

    def create(
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
        every = arrays + state_arrays + rows
        nbytes = sum(a.nbytes for a in every)
        if self.transports.streams("create", nbytes, len(every)):
            req.tensors.extend(map(header_tensor, arrays, names))
            req.state.extend(header_tensor(a) for a in state_arrays)
            for spec, (ids, x, *st) in zip(req.tables, table_arrays, strict=False):
                spec.ids.CopyFrom(header_tensor(ids))
                spec.rows.CopyFrom(header_tensor(x))
                spec.state.extend(header_tensor(a) for a in st)
            chunks = self.chunks(
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
            call = Call(
                "CreateGroup", unary_request(req), deadline, what("CreateGroup")
            )
        msg = yield call
        group: pb.GroupInfo = msg.group
        return group

    def chunks(
        self, message: Any, header: Any, arrays: list[Array]
    ) -> Callable[[], Iterator[Any]]:
        """A client stream: the header, then every array in chunks."""
        return chunk_stream(message, header, arrays, self.host.chunk_bytes)

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None = None,
        shard: int = 0,
    ) -> Op[PushResult]:
        """One push (or part's) to ``shard``, on the way the transport seam
        chooses: in the flat form where the group has one and the gradients are
        native arrays of its tensors' shapes (X back as views of one array).

        Chosen now, when the op is made; a push that is not flat is the seam's
        op itself, so this object stays off the call's stack while it runs."""
        form = self.flat_forms.get(template.group)
        if (
            form is None
            or not form.fits(arrays)
            or self.transports.shm(shard).buffers_of(arrays) is not None
        ):
            return self.transports.push(template, arrays, deadline, out, shard)
        return self._push_flat(form, template, arrays, deadline, out, shard)

    def _push_flat(
        self,
        form: FlatForm,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
        shard: int,
    ) -> Op[PushResult]:
        """The push in ``form``: its gradients joined into one array, X back as
        views of one; a layout the server refuses is learned again
        (``_relearn``) and the push sent as it was."""
        req = pb.PushRequest()
        req.CopyFrom(template)
        req.layout = form.digest
        try:
            flat = form.join(arrays)
            result = yield from self.transports.push(req, [flat], deadline, None, shard)
        except RpcError as exc:
            if not is_layout_mismatch(exc):
                raise
            yield from self._relearn(template.group, deadline)
            return (
                yield from self.transports.push(template, arrays, deadline, out, shard)
            )
        form.give_back(flat)  # sent: the next push may fill it
        if result.values is None:
            return result
        return dataclasses.replace(result, values=form.split(result.values[0]))

    def _relearn(self, group: str, deadline: Deadline) -> Op[None]:
        """The server refused a flat call's layout: forget it and describe the
        group again (its new form is used from the next call)."""
        self.flat_forms.pop(group, None)
        with contextlib.suppress(RpcError):
            yield from self.describe(group, deadline)

    def remember_form(
        self,
        name: str,
        digest: bytes,
        dtype: np.dtype[Any],
        shapes: Sequence[tuple[int, ...]],
        tables: Any = (),
    ) -> None:
        """Keep group (or part) ``name``'s flat form where it has one that pays
        (``_flatform``), else forget any."""
        nbytes = sum(math.prod(s) for s in shapes) * dtype.itemsize
        if digest and not tables and pays(nbytes, len(shapes)):
            self.flat_forms[name] = FlatForm(digest, dtype, shapes)
        else:
            self.flat_forms.pop(name, None)

    def remember(self, info: GroupInfo) -> GroupInfo:
        """Keep what ``info`` says of its group's size, dtype, flat form and pull
        segments."""
        shapes = [dims for _, dims in info.tensors]
        self.remember_form(info.name, info.layout, info.dtype, shapes, info.tables)
        self.sizes[info.name] = info.nbytes
        self.dtypes[info.name] = info.dtype
        sizes = [math.prod(dims) * info.dtype.itemsize for _, dims in info.tensors]
        # with state: X, V and H at most (Adam)
        self.pull_segments[info.name] = (layout(sizes)[1], layout(sizes * 3)[1])
        return info

    def describe(self, name: str, deadline: Deadline) -> Op[GroupInfo]:
        req = pb.DescribeGroupRequest(group=name)
        msg = yield Call(
            "DescribeGroup", unary_request(req), deadline, what("DescribeGroup")
        )
        return self.remember(group_info(msg.group))

    def pull(
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
        reply lands in ``out`` where its arrays fit (shared ``TensorBuffers`` of
        this client: the server writes X straight into them)."""
        size = self.sizes.get(group)
        bufs = None
        if out is not None and not state and encoding == "native":
            bufs = self.transports.shm(shard).buffers_of(list(out))
        unknown = group not in self.pull_segments
        if bufs is None and (
            (size is None and self.host.transport == "auto")
            or (
                unknown and self.host.shared_memory == "on" and self.host.shards is None
            )
        ):
            size = (yield from self.describe(group, deadline)).nbytes
        nbytes = size or 0
        shape = CallShape(
            "pull",
            nbytes,
            nbytes if encoding == "native" else nbytes // 2,  # 2 bytes an element
            0,
            shard,
            native=encoding == "native",
            segment_bytes=self.pull_segments.get(group, (0, 0))[state],
            buffers=bufs,
        )
        req = pb.PullRequest(
            group=group,
            with_state=state,
            min_version=min_version,
            encoding=ENCODING_TO_PROTO[encoding],
        )
        form = self.flat_forms.get(group)
        if form is None or bufs is not None or encoding != "native":
            return (yield from self.transports.pull(req, shape, deadline, out))
        flat = pb.PullRequest()
        flat.CopyFrom(req)
        flat.layout = form.digest
        try:
            t, arrays = yield from self.transports.pull(flat, shape, deadline, None)
        except RpcError as exc:
            if not is_layout_mismatch(exc):
                raise
            yield from self._relearn(group, deadline)
            return (yield from self.transports.pull(req, shape, deadline, out))
        return t, form.split_all(arrays)

    def push_rows(
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
            group=part, client_id=self.host.client_id, seq=next(self.seq)
        )
        if base_version is not None:
            header.base_version = base_version
        if learning_rate is not None:
            header.learning_rate = learning_rate
        entries: list[tuple[str, Array | None, Array]] = []
        for name, g in gradients.items():
            if isinstance(g, tuple):
                rows = encode(g[1], encoding, f"rows of {name!r}")
                entries.append((name, as_indices(g[0], name), rows))
            else:
                entries.append(
                    (name, None, encode(g, encoding, f"gradient of {name!r}"))
                )
        arrays = row_gradients(header, entries)
        msg = yield from self.send_rows(group, header, arrays, deadline)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, None)

    def send_rows(
        self,
        group: str,
        header: pb.PushRowsHeader,
        arrays: list[Array],
        deadline: Deadline,
    ) -> Op[Any]:
        """Send a row push (``row_gradients`` built it), resent while unanswered:
        the reply message."""
        what = f"the row push to group {group} (seq {header.seq}) was not answered"
        chunks = self.chunks(pb.PushRowsRequest, header, arrays)
        call = Call("PushRows", chunks, deadline, what)
        return (yield from resending(call, group, header.seq, self.host.address))

    def pull_rows(
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
            indices = as_indices(idx, name)
            header.tensors.add(name=name, indices=header_tensor(indices))
            arrays.append(indices)
        chunks = self.chunks(pb.PullRowsRequest, header, arrays)
        what = f"the row pull of group {group} was not answered"
        names, rows = yield Call("PullRows", chunks, deadline, what, rows_reader)
        return dict(zip(names, rows, strict=True))

    def list_rows(
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
        msg = yield Call("ListRows", unary_request(req), deadline, what("ListRows"))
        return RowsPage(
            tensor_to_array(msg.ids, "ids").copy(),
            {t.name: tensor_to_array(t, t.name).copy() for t in msg.rows},
            msg.next_page_token,
            int(msg.row_count),
            int(msg.update_count),
        )
