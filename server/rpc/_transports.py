"""The server's transport seam (``Transports``): from a request, where a push's
gradients come from (a ``GradientSource``) and where a reply's values go (a
``ValuesSink`` for a push, a ``PullSink`` for a pull), one class per way the bytes
travel, the client's ``_transport`` seen from the other end:

- inline: the bytes inside the unary message (``InlineGradients``, ``InlineValues``,
  ``InlinePull``);
- stream: ~1 MiB chunks on a gRPC stream (``StreamGradients``, ``StreamPull``; X of
  a PushPullStream goes out while the push steps, through ``FrameSink``);
- shared memory: the client's segment named by a region (``RegionGradients``,
  ``RegionValues``, ``RegionPull``; ``_shm`` maps and checks it);
- data channel: one frame on the call's socket (``ChannelGradients``,
  ``ChannelValues``, ``ChannelPull``; ``_datachannel`` owns the sockets).

A source's ``gradients`` is a context: the arrays it yields (pooled buffers, mapped
memory) are valid until it exits. A push's sink's ``check`` runs before the step (a
reply region that cannot be used refuses the push before it applies), ``send``
after. A pull's sink (``_pulls``) runs the pull (``reply``): it holds what it
needs around it (the data channel, the reply's bytes in the in-flight budget) and
asks the store for the values the way it sends them.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    PROTO_TO_DTYPE,
    TensorAssembler,
    TensorFormatError,
    declared_nbytes,
    encode_chunk,
    fill_flat,
    header_tensors,
    tensor_spec,
    write_tensor,
)

from ..errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from ..kernels._finite import finite_checker
from ..store import PushOutcome, PushTicket
from ..store import ValuesSink as StoreSink
from ..store._flat import FlatArrays, flat_views, kept_flat
from ..transports._datachannel import ChannelTable, DataChannel, principal_of
from ..transports._receive import GradientPool, Lease, receive
from ..transports._shm import Caller, SharedMemory
from ._common import caller_of, raise_if_cut_off, timeout_of
from ._convert import decoded
from ._flatform import FlatEmitter, gradient_names
from ._pulls import (
    ChannelPull,
    InlinePull,
    PullSink,
    RegionPull,
    ReplyBytes,
    StreamPull,
)

__all__ = [
    "ChannelGradients",
    "ChannelValues",
    "FrameSink",
    "GradientSource",
    "InlineGradients",
    "InlineValues",
    "RegionGradients",
    "RegionValues",
    "StreamGradients",
    "Transports",
    "ValuesSink",
    "bare_specs",
    "pooled",
]

Array = np.ndarray[Any, Any]
Spec = tuple[np.dtype[Any], tuple[int, ...]]
Reply = pb.PushResponse | pb.PushStreamResponse


class GradientSource(Protocol):
    def gradients(self) -> AbstractContextManager[tuple[list[Array], bool]]:
        """The gradients, and whether they are known to be finite (checked as they
        landed)."""
        ...


class ValuesSink(Protocol):
    def check(self) -> None:
        """Refuse, before the push applies, what would keep X from being sent."""
        ...

    def emitter(self, ticket: PushTicket, flat: bool = False) -> StoreSink | None:
        """Where the store writes X as the push makes it (under the group's
        lock), or None: the store hands X to ``send`` as values. ``flat``: X as
        one array (the flat form; blocks of it come through ``FlatBlocks``)."""
        ...

    def send(
        self, reply: Reply, values: Sequence[Array] | None, names: Sequence[str]
    ) -> None:
        """X of the push: into ``reply`` or beside it (``values`` None: the
        ``emitter`` took it)."""
        ...


def pooled(pool: GradientPool, group: str, headers: Sequence[pb.Tensor]) -> Lease:
    """Buffers of ``pool`` for gradients of these headers (none when the headers
    are wrong: the reader then says what is wrong with them)."""
    try:
        specs = [tensor_spec(t, t.name, encoded=True) for t in headers]
        return pool.lease(group, specs)
    except (ValueError, OverflowError, MemoryError):
        return Lease([], None)


def bare_specs(req: pb.PushRequest, where: str, *, encoded: bool = False) -> list[Spec]:
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


# -- inline ---------------------------------------------------------------------------
class InlineGradients:
    """Gradients inside the unary Push (encoded ones widened)."""

    def __init__(
        self, req: pb.PushRequest, ticket: PushTicket, specs: Sequence[Spec]
    ) -> None:
        self.req = req
        self.ticket = ticket
        self.specs = specs  # checked against the group: its dtype and shapes

    def gradients(self) -> AbstractContextManager[tuple[list[Array], bool]]:
        tensors = self.req.gradients
        if len(tensors) == 1:  # read in place: no copy
            return nullcontext(([self._one(tensors[0])], False))
        return nullcontext((self._flat(tensors), False))

    def _one(self, t: pb.Tensor) -> Array:
        """The only gradient, a view of the request's bytes (widened when encoded).
        Its header was checked (``_validate_push``): bytes of the length it
        declares are all that is left to see, as ``decoded`` sees them."""
        raw = t.raw_data  # each read copies: read once
        shape = self.specs[0][1]
        dtype = PROTO_TO_DTYPE.get(t.dtype)
        if dtype is None or t.encoding or len(raw) != math.prod(shape) * dtype.itemsize:
            return self._decoded(0, t)  # encoded (widened), or refused
        return np.frombuffer(raw, dtype).reshape(shape)

    def _decoded(self, i: int, t: pb.Tensor) -> Array:
        what = f"gradient {i + 1} ({self.ticket.names[i]!r})"
        return decoded(t, what, f"gradients[{i}].raw_data", encoded=True)

    def _flat(self, tensors: Sequence[pb.Tensor]) -> list[Array]:
        """The gradients copied into one flat buffer (``FlatArrays``): the push
        then steps as one array. The headers were checked (``_validate_push``);
        a tensor whose bytes do not match its header is refused as ``decoded``
        refuses it."""
        dtype = self.specs[0][0] if self.specs else self.ticket.dtype
        shapes = [dims for _, dims in self.specs]
        flat = np.empty(sum(map(math.prod, shapes)), dtype)
        out = FlatArrays(flat_views(flat, shapes), flat)

        def parts() -> Iterator[tuple[bytes, int, int]]:
            for i, (t, view) in enumerate(zip(tensors, out, strict=True)):
                raw, n = t.raw_data, view.size
                if len(raw) != n * (2 if t.encoding else dtype.itemsize):
                    self._decoded(i, t)  # raises: the bytes do not match the header
                yield raw, n, t.encoding

        fill_flat(flat, parts())
        return out


class InlineValues:
    """X inside the reply."""

    def check(self) -> None:
        pass

    def emitter(self, ticket: PushTicket, flat: bool = False) -> None:
        """None: the store hands X over as values (``send``)."""
        return None

    def send(
        self, reply: Reply, values: Sequence[Array] | None, names: Sequence[str]
    ) -> None:
        assert values is not None  # (no emitter)
        for v, n in zip(values, names, strict=True):
            write_tensor(reply.values.add(), v, n)


# -- stream ---------------------------------------------------------------------------
class StreamGradients:
    """Gradients in chunks after a stream's header, assembled into the group's
    pooled buffers where they fit, each block checked for NaN and inf as it lands
    (``_receive``)."""

    def __init__(
        self,
        it: Iterator[Any],
        headers: Sequence[pb.Tensor],
        names: Sequence[str],
        lease: Lease,
        cut_off: Callable[[], None],
    ) -> None:
        self.it = it
        self.headers = headers
        self.names = names
        self.lease = lease
        self.cut_off = cut_off  # raises when the client went away mid-stream

    @contextmanager
    def gradients(self) -> Iterator[tuple[list[Array], bool]]:
        with self.lease:
            yield self.receive()

    def receive(self) -> tuple[list[Array], bool]:
        """The gradients now (the caller gives the lease back)."""
        asm = TensorAssembler(
            self.headers, self.names, encoded=True, out=self.lease.arrays
        )
        try:
            got = receive(self.it, asm)
        except TensorFormatError:
            self.cut_off()
            raise
        return kept_flat(got.arrays, self.lease.arrays), got.finite


_END = object()
_REPLY_CHUNK_FIELD = pb.PushPullStreamResponse.DESCRIPTOR.fields_by_name["chunk"].number


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class FrameSink:
    """Takes X from the store as a push steps it (a ``ValuesSink`` of the store)
    and hands it, as encoded PushPullStream frames, to the thread that sends the
    reply.

    The push runs on a thread of its own (``run``), so each block is copied out
    under the group's lock and sent while the next block steps. The copy goes into
    the push's own gradient buffers (``room``) where they match X: the step is
    element-wise, so a block's gradient is spent once its X is final, and the
    reply then costs no memory beyond them (X copied into frames as it stepped
    held a second copy of X when the step outran the network). The frames are
    encoded from there as the reply is sent, and ``release`` (the buffers' lease)
    runs once both the push and the sending are done with them. Without room,
    each block is encoded into its frames at once. After ``close`` (the caller
    went away) frames are dropped; the push still finishes.
    """

    def __init__(
        self,
        headers: Sequence[pb.Tensor],
        chunk_bytes: int,
        room: Sequence[Array] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        self._headers = headers
        self._chunk_bytes = chunk_bytes
        self._frames: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room = list(room)
        self._views: list[memoryview] = []
        self._xs: list[Array] = []
        self._itemsizes: list[int] = []
        self._closed = False
        self._release = release
        self._users = 2  # the push (``run``) and the sending (``frames``/``close``)
        self._users_lock = threading.Lock()

    def lend(self, room: Sequence[Array], release: Callable[[], None]) -> None:
        """The push's gradient buffers, received: X is copied into them as their
        elements are spent, and ``release`` gives them back once both the push
        and the sending are done with them."""
        self._room = list(room)
        self._release = release

    def begin(self, outcome: PushOutcome, xs: Sequence[Array]) -> None:
        self._itemsizes = [x.itemsize for x in xs]
        if _fits_room(self._room, xs):
            self._xs = list(xs)
            views = [r.reshape(-1) for r in self._room]
        else:
            self._room = []
            views = list(xs)
        self._views = [memoryview(v).cast("B") for v in views]  # type: ignore[arg-type]
        header = pb.PushResponse(
            update_count=outcome.update_count,
            applied=outcome.applied,
            duplicate=outcome.duplicate,
            values=self._headers,
        )
        self._put(pb.PushPullStreamResponse(header=header))

    def block(self, index: int, start: int, stop: int) -> None:
        if self._closed:
            return
        if self._room:
            flat = self._room[index].reshape(-1)
            np.copyto(flat[start:stop], self._xs[index][start:stop])
            self._put((index, start, stop))
        else:
            self._put_all(self._encode(index, start, stop))

    def _encode(self, index: int, start: int, stop: int) -> Iterator[bytes]:
        """The frames of elements ``start:stop`` of X ``index``."""
        size = self._itemsizes[index]
        view = self._views[index]
        step = self._chunk_bytes
        for a in range(start * size, stop * size, step):
            b = min(a + step, stop * size)
            yield encode_chunk(_REPLY_CHUNK_FIELD, index, a, view[a:b])

    def _put(self, item: Any) -> None:
        if not self._closed:
            self._frames.put(item)

    def _put_all(self, items: Iterator[Any]) -> None:
        if not self._closed:
            for item in items:
                self._frames.put(item)

    def run(self, push: Callable[[], Any]) -> None:
        try:
            push()
        except BaseException as exc:  # noqa: BLE001 - raised on the sending thread
            self._frames.put(_Failed(exc))
        else:
            self._frames.put(_END)
        finally:
            self._xs = []
            self._done_with_room()

    def frames(self) -> Iterator[Any]:
        while (item := self._frames.get()) is not _END:
            if isinstance(item, _Failed):
                error, item.error = item.error, None  # type: ignore[assignment]
                raise error
            if isinstance(item, tuple):
                yield from self._encode(*item)
            else:
                yield item

    def close(self) -> None:
        """The sending is over (the reply sent, or the caller gone)."""
        if not self._closed:
            self._closed = True
            self._done_with_room()

    def _done_with_room(self) -> None:
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._views = []
            self._room = []
            if self._release is not None:
                self._release()


def _fits_room(room: Sequence[Array], xs: Sequence[Array]) -> bool:
    """Whether X can be copied into ``room``, array for array (same dtype and
    size, C-contiguous and writable)."""
    return len(room) == len(xs) and all(
        r.dtype == x.dtype
        and r.size == x.size
        and r.flags.c_contiguous
        and r.flags.writeable
        for r, x in zip(room, xs, strict=True)
    )


# -- shared memory --------------------------------------------------------------------
class RegionGradients:
    """Gradients in the client's segment, read in place by the store.

    ``spent`` (known once ``gradients`` is entered): the push asked for X in the
    same segment and an earlier answer to it already wrote X over the gradients
    (``RegionValues``); it can only be a resend after a lost reply, which the
    store answers from its exactly-once window or refuses (``spent``)."""

    def __init__(
        self,
        shm: SharedMemory,
        req: pb.PushRequest,
        ticket: PushTicket,
        caller: Caller,
        names: Sequence[str],
    ) -> None:
        self.shm = shm
        self.region = req.gradients_region
        self.reply = req.reply_region if req.HasField("reply_region") else None
        self.specs = bare_specs(req, "in gradients_region")
        self.caller = caller
        self.names = names
        self.spent = False

    @contextmanager
    def gradients(self) -> Iterator[tuple[list[Array], bool]]:
        reply, caller = self.reply, self.caller
        self.spent = reply is not None and self.shm.is_spent(self.region, reply, caller)
        # X in place of spent gradients is finite: nothing is checked or stepped
        finite = self.spent
        try:
            with self.shm.read(
                self.region, self.specs, self.names, caller, spent=self.spent
            ) as grads:
                if isinstance(grads, FlatArrays):  # packed: the push steps one array
                    yield FlatArrays(grads, grads.flat), finite
                else:
                    yield list(grads), finite
        finally:
            self.shm.finished(self.region)


class RegionValues:
    """X written into the client's reply segment (inline when it does not fit
    there, e.g. the group was replaced)."""

    def __init__(
        self,
        shm: SharedMemory,
        region: pb.SharedMemoryRegion,
        caller: Caller,
        gradients: pb.SharedMemoryRegion | None = None,
    ) -> None:
        self.shm = shm
        self.region = region
        self.caller = caller
        # the push's gradients are in this very segment: X goes over them
        self.gradients = gradients if _same_segment(gradients, region) else None
        self._views: list[Array] = []  # where X goes in the segment, per tensor
        self._offsets: list[int] = []
        self._shapes: Sequence[tuple[int, ...]] = ()
        self._xs: Sequence[Array] = ()
        self._generation: Array | None = None  # set at ``begin``: X over gradients

    def check(self) -> None:
        self.shm.check(self.region, self.caller, "reply_region")
        grads = self.gradients
        if grads is not None and grads.generation != self.region.generation:
            # X over gradients moves the segment one generation on from theirs
            raise InvalidArgument(
                f"reply_region names segment {self.region.segment!r} of "
                "gradients_region at another generation: X written there goes "
                "over the gradients, so both regions must name the segment as it "
                "is now",
                reason="STALE_SEGMENT",
                field="reply_region.generation",
            )

    def emitter(self, ticket: PushTicket, flat: bool = False) -> RegionValues | None:
        """This sink as the store's ``ValuesSink``: each block of X is copied into
        the segment as the step makes it final, under the group's lock, and is
        the reply (no copy of X beside it); None where X does not fit there.
        ``flat``: X as one array, of the group's elements.

        In the gradients' own segment (one segment for the call), a block of X
        goes over the block of gradients the step has just spent (the step is
        element-wise), so they must lie where X goes; else (None) X is written
        whole after the step. The segment's generation moves on before the first
        block (``begin``): a resend of the push then finds its gradients spent
        (``RegionGradients``) rather than reading X as gradients."""
        sizes = [math.prod(s) for s in ticket.shapes]
        shapes = ticket.shapes
        if flat:
            sizes = [sum(sizes)]
            shapes = ((sizes[0],),)
        found = self.shm.reply_views(self.region, ticket.dtype, sizes, self.caller)
        if found is None:
            return None
        self._views, self._offsets = found
        if self.gradients is not None:
            if list(self.gradients.offsets) != self._offsets:
                self._views, self._offsets = [], []
                return None
            self._generation = self.shm.generation_of(self.region, self.caller)
        self._shapes = shapes
        return self

    def begin(self, outcome: PushOutcome, xs: Sequence[Array]) -> None:
        if self._generation is not None:
            self._generation[0] = self.region.generation + 1
        self._xs = xs

    def block(self, index: int, start: int, stop: int) -> None:
        self._views[index][start:stop] = self._xs[index][start:stop]

    def send(
        self, reply: Reply, values: Sequence[Array] | None, names: Sequence[str]
    ) -> None:
        try:
            self._send(reply, values, names)
        finally:
            self.shm.finished(self.region)

    def _send(
        self, reply: Reply, values: Sequence[Array] | None, names: Sequence[str]
    ) -> None:
        if values is None:  # written as the push stepped (``emitter``)
            self._xs = ()
            self._generation = None
            region = self.shm.written(self.region, self._offsets, self.caller)
            reply.values_region.CopyFrom(region)
            shaped = [
                v.reshape(s) for v, s in zip(self._views, self._shapes, strict=True)
            ]
            reply.values.extend(header_tensors(shaped, names))
            self._views = []
            return
        written = self.shm.write(self.region, values, self.caller)
        if written is None:
            InlineValues().send(reply, values, names)
            return
        reply.values_region.CopyFrom(written)
        reply.values.extend(header_tensors(values, names))


def _segment_bytes(req: pb.PushRequest) -> int:
    """The tensor bytes a unary push maps of its client's segments: its gradients
    in one, and X in its reply segment when that is another one (X over the
    gradients maps nothing more)."""
    if req.HasField("transfer"):
        return 0
    grads = req.HasField("gradients_region")
    reply = (
        req.return_values
        and req.HasField("reply_region")
        and not (grads and req.reply_region.segment == req.gradients_region.segment)
    )
    declared = sum(declared_nbytes(t) for t in req.gradients) if grads or reply else 0
    return declared * (int(grads) + int(reply))


def _same_segment(a: pb.SharedMemoryRegion | None, b: pb.SharedMemoryRegion) -> bool:
    return a is not None and a.segment == b.segment


# -- the data channel -----------------------------------------------------------------
def channel_frame_bytes(specs: Sequence[Spec], codes: Sequence[int]) -> tuple[int, int]:
    """(bytes the gradients' frame carries, bytes of X in the group's dtype): an
    encoded gradient travels in 2 bytes per element."""
    counts = [math.prod(dims) for _, dims in specs]
    native = sum(n * d.itemsize for n, (d, _) in zip(counts, specs, strict=True))
    framed = sum(
        n * (2 if c else d.itemsize)
        for n, c, (d, _) in zip(counts, codes, specs, strict=True)
    )
    return framed, native


class ChannelGradients:
    """Gradients in one frame on the call's data channel, received into the
    group's pooled buffers (encoded ones widened), each block checked for NaN and
    inf as it lands."""

    def __init__(
        self,
        ch: DataChannel,
        req: pb.PushRequest,
        specs: Sequence[Spec],
        lease: Lease,
        is_active: Callable[[], bool],
        deadline: float | None,
    ) -> None:
        self.ch = ch
        self.req = req
        self.specs = specs
        self.codes = [t.encoding for t in req.gradients]
        self.lease = lease
        self.is_active = is_active
        self.deadline = deadline

    @contextmanager
    def gradients(self) -> Iterator[tuple[list[Array], bool]]:
        expected, _ = channel_frame_bytes(self.specs, self.codes)
        tid = self.req.transfer.transfer_id
        nbytes = self.ch.read_header(tid, self.is_active, self.deadline)
        if nbytes != expected:
            self.lease.release()
            raise InvalidArgument(
                f"the data channel frame carries {nbytes} bytes; the "
                f"gradients' headers declare {expected}",
                reason="DATA_FRAME_SIZE",
            )
        with self.lease:
            grads = self.lease.arrays or [np.empty(d, t) for t, d in self.specs]
            yield grads, self._read_checked(grads)

    def _read_checked(self, grads: list[Array]) -> bool:
        """Receive the frame into ``grads``; whether every element was finite."""
        flats = [g.reshape(-1) for g in grads]
        checked = [0] * len(grads)
        all_finite = finite_checker()
        finite = True

        def landed(i: int, elements: int) -> None:
            nonlocal finite
            if finite and elements > checked[i]:
                finite = all_finite(flats[i][checked[i] : elements])
                checked[i] = elements

        self.ch.read_into(grads, self.is_active, self.deadline, landed, self.codes)
        return finite


class ChannelValues:
    """X as one frame on the call's data channel, after the reply says so. The
    push has applied by then: a failure to send is the transport's (UNAVAILABLE,
    retried), and the message says the push was applied, so a resend with the same
    seq is answered by exactly-once without a second step."""

    def __init__(
        self, ch: DataChannel, req: pb.PushRequest, deadline: float | None
    ) -> None:
        self.ch = ch
        self.req = req
        self.deadline = deadline

    def check(self) -> None:
        pass

    def emitter(self, ticket: PushTicket, flat: bool = False) -> None:
        """None: X is sent from the values the store hands over."""
        return None

    def send(
        self, reply: Reply, values: Sequence[Array] | None, names: Sequence[str]
    ) -> None:
        assert isinstance(reply, pb.PushResponse)  # a unary Push's transfer
        assert values is not None  # (no emitter)
        reply.values.extend(header_tensors(values, names))
        reply.values_on_channel = True
        req = self.req
        try:
            self.ch.send(req.transfer.transfer_id, values, self.deadline)
        except (OSError, DeadlineExceeded) as exc:
            raise Unavailable(
                f"push seq {req.seq} to group {req.group!r} was applied (T="
                f"{reply.update_count}) but its values could not be sent on the "
                f"data channel ({exc}); resend it with the same client_id and seq "
                "for them",
                reason="DATA_CHANNEL_BROKEN",
                metadata={"group": req.group, "update_count": reply.update_count},
            ) from None


def _then_raise(specs: list[Spec], error: Exception) -> Iterator[Spec]:
    yield from specs  # the headers parsed before a malformed one, then its error
    raise error


# -- the seam -------------------------------------------------------------------------
Way = tuple[PushTicket, GradientSource, ValuesSink]


class Transports:
    """The server's transport seam: from a request, where a push's gradients come
    from (a ``GradientSource``) and where the reply's values go (a ``ValuesSink``
    for a push, a ``PullSink`` for a pull). The only place that reads which way a
    request's tensors travel (inline, a stream, shared memory, the data channel);
    the RPCs run one step or pull routine over what it gives.

    ``validate`` checks a push's gradient headers against its group (the ticket
    the step takes), ``reply_bytes(context, stream)`` holds a reply's bytes in the
    in-flight budget; ``data_channels`` is None when the server serves none.
    """

    def __init__(
        self,
        *,
        validate: Callable[[str, Iterable[Spec], bytes], PushTicket],
        reply_bytes: ReplyBytes,
        shared_memory: SharedMemory,
        data_channels: ChannelTable | None,
        gradient_pool: GradientPool,
        chunk_bytes: int,
    ) -> None:
        self._validate_specs = validate
        self._reply_bytes = reply_bytes
        self._shm = shared_memory
        self._data = data_channels
        self._pool = gradient_pool
        self.chunk_bytes = chunk_bytes

    def _validate(self, req: pb.PushRequest) -> tuple[PushTicket, list[Spec]]:
        """Check the gradients' header against the group before reading any bytes:
        the push's ticket, and the gradients' (dtype, dims). A malformed header is
        raised as the store reads it, after the group: an unknown one is NOT_FOUND."""
        specs: list[Spec] = []
        for i, t in enumerate(req.gradients):
            try:
                specs.append(tensor_spec(t, f"gradient {i + 1}", encoded=True))
            except Exception as exc:  # noqa: BLE001 - raised as the store reads it
                malformed = exc
                break
        else:  # with a layout, the flat form: one gradient of the group's elements
            return self._validate_specs(req.group, specs, req.layout), specs
        self._validate_specs(req.group, _then_raise(specs, malformed), req.layout)
        raise malformed

    # -- pushes --------------------------------------------------------------------
    def push(
        self, req: pb.PushRequest, context: Any, chunks: Iterator[Any] | None = None
    ) -> AbstractContextManager[Way]:
        """The ticket, source and sink of a Push (``chunks`` None) or a
        PushStream (the chunks after its header), held for the push's step."""
        if chunks is None and req.HasField("transfer"):
            return self._push_on_channel(req, context)
        if chunks is not None and req.HasField("gradients_region"):
            raise InvalidArgument(
                "a PushStream carries its gradients as chunks; gradients in shared "
                "memory (gradients_region) go in a unary Push",
                field="header.gradients_region",
            )
        ticket, specs = self._validate(req)
        caller = None
        source: GradientSource
        if chunks is not None:
            source = self._stream_gradients(req, ticket, chunks, context)
        elif req.HasField("gradients_region"):
            names = gradient_names(req, ticket)
            caller = caller_of(context)
            source = RegionGradients(self._shm, req, ticket, caller, names)
        else:
            source = InlineGradients(req, ticket, specs)
        sink: ValuesSink = _INLINE_VALUES
        if req.HasField("reply_region"):
            caller = caller or caller_of(context)
            grads = req.gradients_region if req.HasField("gradients_region") else None
            sink = RegionValues(self._shm, req.reply_region, caller, grads)
        mapped = _segment_bytes(req)
        if mapped:
            return self._holding(context, mapped, (ticket, source, sink), req)
        return nullcontext((ticket, source, sink))  # nothing held beside the call

    @contextmanager
    def _holding(
        self, context: Any, nbytes: int, way: Way, req: pb.PushRequest
    ) -> Iterator[Way]:
        """``way``, with ``nbytes`` of the client's segments it maps held in the
        in-flight budget, and its gradients' segment (``SharedMemory.pushing``),
        until the call ends."""
        with self._reply_bytes(context, False) as hold:
            hold.admit(nbytes, what="this push's shared-memory segments map")
            with self._shm.pushing(req, timeout_of(context)):
                yield way

    @contextmanager
    def push_pull(
        self, req: pb.PushRequest, chunks: Iterator[Any], context: Any
    ) -> Iterator[tuple[PushTicket, StreamGradients, FrameSink | FlatEmitter]]:
        """The ticket, source and sink of a PushPullStream: gradients in chunks, X
        in frames sent as the push steps (the reply's bytes held meanwhile)."""
        if req.HasField("gradients_region") or req.HasField("reply_region"):
            raise InvalidArgument(
                "a PushPullStream carries tensors as chunks; tensors in shared memory "
                "go in a unary Push",
                field="header.gradients_region",
            )
        ticket, _ = self._validate(req)
        headers = list(req.gradients)
        with self._reply_bytes(context, True) as hold:
            hold.admit(
                sum(declared_nbytes(t) for t in headers),
                what="this push's reply carries",
            )
            source = self._stream_gradients(req, ticket, chunks, context)
            if req.layout:  # X back in the flat form too
                values = [
                    pb.Tensor(name="X", dtype=headers[0].dtype, dims=headers[0].dims)
                ]
                yield (
                    ticket,
                    source,
                    FlatEmitter(FrameSink(values, self.chunk_bytes), ticket),
                )
                return
            values = [
                pb.Tensor(name=n, dtype=t.dtype, dims=t.dims)
                for n, t in zip(ticket.names, headers, strict=True)
            ]
            yield ticket, source, FrameSink(values, self.chunk_bytes)

    def _stream_gradients(
        self, req: pb.PushRequest, ticket: PushTicket, it: Iterator[Any], context: Any
    ) -> StreamGradients:
        headers = list(req.gradients)
        names = gradient_names(req, ticket)
        lease = pooled(self._pool, ticket.group, headers)
        return StreamGradients(
            it, headers, names, lease, lambda: raise_if_cut_off(context)
        )

    @contextmanager
    def _push_on_channel(self, req: pb.PushRequest, context: Any) -> Iterator[Way]:
        """A push whose gradients arrive as one frame on the data channel, each
        block checked for NaN and inf as it lands; X, when asked for, goes back as
        one frame."""
        with self._channel(req.transfer, context) as (ch, deadline):
            ticket, _ = self._validate(req)
            specs = bare_specs(req, "on the data channel", encoded=True)
            codes = [t.encoding for t in req.gradients]
            framed, native = channel_frame_bytes(specs, codes)
            with self._reply_bytes(context, False) as hold:
                hold.admit(
                    framed + (native if req.return_values else 0),
                    what="this push's gradients (and X) carry",
                )
                lease = pooled(self._pool, ticket.group, list(req.gradients))
                source = ChannelGradients(
                    ch, req, specs, lease, context.is_active, deadline
                )
                yield ticket, source, ChannelValues(ch, req, deadline)

    # -- pulls ---------------------------------------------------------------------
    def pull(
        self, req: pb.PullRequest | pb.PullStreamRequest, context: Any
    ) -> PullSink:
        """Where a Pull's (or a PullStream's) values go."""
        if isinstance(req, pb.PullStreamRequest):
            hold = self._reply_bytes(context, True)
            return StreamPull(req.encoding, hold, self.chunk_bytes)
        if req.HasField("transfer"):
            channel = self._channel(req.transfer, context)
            return ChannelPull(channel, req, self._reply_bytes(context, False))
        inline = InlinePull(req.encoding, self._reply_bytes(context, False))
        if req.HasField("reply_region"):
            hold = self._reply_bytes(context, False)
            caller = caller_of(context)
            return RegionPull(self._shm, req.reply_region, caller, inline, hold)
        return inline

    # -- the data channel ----------------------------------------------------------
    @contextmanager
    def _channel(
        self, transfer: pb.DataTransfer, context: Any
    ) -> Iterator[tuple[DataChannel, float | None]]:
        """The call's data channel (closed if the call fails) and its deadline."""
        data = self.data_channels()
        timeout = timeout_of(context)
        deadline = None if timeout is None else time.monotonic() + timeout
        principal = principal_of(context.invocation_metadata())
        with data.use(transfer.channel, principal, transfer.transfer_id) as ch:
            yield ch, deadline

    def data_channels(self) -> ChannelTable:
        """The server's data channels (FAILED_PRECONDITION when it serves none)."""
        if self._data is None:
            raise FailedPrecondition(
                "this server serves no data channel (start it with --data-port)",
                reason="DATA_CHANNEL_OFF",
            )
        return self._data

    def shared_memory(self) -> SharedMemory:
        return self._shm


_INLINE_VALUES = InlineValues()
