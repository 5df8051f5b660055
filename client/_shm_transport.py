"""Tensor bytes through shared memory (``TensorTransport``, see ``_transport``): the
client's segments in /dev/shm (layout: ``onnxps.wire.shm``), a unary message naming
their region; and the link that says hello to the server and keeps the segments."""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import header_tensors, tensor_to_array
from onnxps.wire.shm import layout, new_key, sweep_orphans

from ._errors import (
    DeadlineExceededError,
    RpcError,
    SharedMemoryError,
    UnavailableError,
)
from ._grpc_transport import Transport, pull_waited, pushed_what, resending
from ._ops import Call, Deadline, Op, one_call, unary_request, what
from ._records import PushResult
from ._replies import inline_values
from .shm import Segment, SegmentPool, SharedMemoryMode, TensorBuffers, hello_segment

__all__ = [
    "SHARED_MEMORY_THRESHOLD_BYTES",
    "BufferTransport",
    "SegmentTransport",
    "SharedMemoryLink",
    "ShmHost",
    "released",
]

log = logging.getLogger("onnxps.client")

Array = np.ndarray[Any, Any]

# With shared_memory="auto", tensors of a call at least this large go through shared
# memory (below it, inline bytes cost less than mapping a segment on the server).
SHARED_MEMORY_THRESHOLD_BYTES = 64 << 10
# Refusals of a hello that mean "not here": the client falls back to bytes.
_HELLO_REFUSALS = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
)


class ShmHost(Protocol):
    """What the link reads from its client, live."""

    address: str
    addresses: list[str]
    transport: Transport
    shared_memory: SharedMemoryMode
    shards: int | None


@contextlib.contextmanager
def released(pool: SegmentPool | None, segs: list[Segment]) -> Iterator[None]:
    """Give a call's segments back to ``pool`` when it ends, however it ends."""
    try:
        yield
    finally:
        for seg in segs:
            if pool is not None:
                pool.release(seg)


class SharedMemoryLink:
    """The same-host transport of one client: "auto" (with transport="auto") tries
    it for calls of at least SHARED_MEMORY_THRESHOLD_BYTES and falls back to bytes
    where the hello is refused; "on" uses it for every push and pull and raises
    SharedMemoryError where it cannot work; "off" never uses it."""

    def __init__(self, host: ShmHost, shard: int = 0) -> None:
        self.host = host
        # the server this link shares memory with: the client's one server, or
        # shard ``shard`` of a cluster (whose calls the caller routes there)
        self.address = host.address if host.shards is None else host.addresses[shard]
        self.pool: SegmentPool | None = None
        self.refused: str | None = None
        # TensorBuffers this client made (closed with it); a push or pull of them
        # moves no tensor bytes through the client.
        self.buffers_made: weakref.WeakSet[TensorBuffers] = weakref.WeakSet()

    # -- the hello and the pool ----------------------------------------------------
    def segment_pool(self, nbytes: int, deadline: Deadline) -> Op[SegmentPool | None]:
        """The segments of the same-host transport when a call of ``nbytes`` should
        use it (a hello on first use), else None (bytes over gRPC)."""
        host = self.host
        if host.shared_memory == "off":
            return None
        if host.shared_memory == "auto" and (
            host.transport != "auto" or nbytes < SHARED_MEMORY_THRESHOLD_BYTES
        ):
            return None  # small, or a gRPC transport was asked for by name
        if self.pool is not None:
            return self.pool
        if self.refused is not None:
            self.refuse(self.refused)
            return None
        return (yield from self._hello(deadline))

    def _hello(self, deadline: Deadline) -> Op[SegmentPool | None]:
        key = new_key()  # the hello binds it to this client's token and uid
        try:
            seg, nonce = hello_segment(key=key)
        except OSError as exc:
            self.refuse(f"cannot create a segment in /dev/shm ({exc.strerror})")
            return None
        try:
            sweep_orphans()
            req = pb.SharedMemoryHelloRequest(segment=seg.name, key=key)
            hello = unary_request(req)
            msg = yield Call("SharedMemoryHello", hello, deadline, what("the hello"))
        except RpcError as exc:
            if exc.code not in _HELLO_REFUSALS:
                raise
            self.refuse(f"{exc.code.name}: {exc.details}")
            return None
        finally:
            seg.close()
        if msg.nonce != nonce:
            self.refuse(
                "the server read another nonce: it does not share this /dev/shm"
            )
            return None
        log.info("shared memory with %s: tensors move through /dev/shm", self.address)
        self.pool = SegmentPool(key=key)
        return self.pool

    def refuse(self, why: str) -> None:
        """Remember that the hello failed: "on" raises, "auto" falls back (once
        logged)."""
        first = self.refused is None
        self.refused = why
        if self.host.shared_memory == "on":
            raise SharedMemoryError(
                f"shared_memory='on' but the server at {self.address} cannot "
                f"share memory with this client: {why}"
            )
        if first:
            log.info(
                "shared memory with %s is not possible (%s); sending tensor bytes "
                "over gRPC",
                self.address,
                why,
            )

    def segments(
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
            if self.host.shared_memory == "on":
                raise SharedMemoryError(why) from None
            log.info("%s: this call sends its tensors over gRPC", why)
            return None
        return segs

    def guarded(self, op: Op[Any]) -> Op[Any]:
        """``op``; when it fails because the server went away, the segments are
        unlinked (and the next call says hello again, to whatever answers then)."""
        try:
            return (yield from op)
        except (UnavailableError, DeadlineExceededError):
            self.close(closing_client=False)
            raise

    def close(self, *, closing_client: bool) -> None:
        """Unlink the segments (and, when the client closes, its buffers')."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
        if closing_client:
            for bufs in list(self.buffers_made):
                bufs.close()

    # -- choosing ------------------------------------------------------------------
    def push_transport(
        self,
        arrays: Sequence[Any],
        sizes: list[int],
        native: bool,
        return_values: bool,
        deadline: Deadline,
    ) -> Op[BufferTransport | SegmentTransport | None]:
        """The shared-memory transport of a push, or None (another way)."""
        if not native:  # an encoded push: its 2-byte values cross no network here
            return None
        pool = yield from self.segment_pool(sum(sizes), deadline)
        if pool is None:
            return None
        bufs = self.buffers_of(arrays)
        if bufs is not None:
            return BufferTransport(self, pool, bufs)
        segs = self.segments(pool, sizes, 1)  # X comes back over the gradients
        if segs is None:
            return None
        return SegmentTransport(self, pool, segs)

    def pull_transport(
        self, nbytes: int, segment_bytes: int, deadline: Deadline
    ) -> Op[SegmentTransport | None]:
        """The shared-memory transport of a pull whose reply needs a segment of
        ``segment_bytes``, or None."""
        pool = yield from self.segment_pool(nbytes, deadline)
        segs = self.segments(pool, [segment_bytes], 1)
        if pool is None or segs is None:
            return None
        return SegmentTransport(self, pool, segs)

    # -- tensor buffers ------------------------------------------------------------
    def make_buffers(
        self, group: str, dtype: np.dtype[Any], shapes: list[tuple[int, ...]],
        deadline: Deadline,
    ) -> Op[TensorBuffers]:  # fmt: skip
        """Arrays shaped like a group's tensors, in shared memory when this client
        shares it with the server."""
        sizes = [dtype.itemsize * math.prod(d) for d in shapes]
        pool = None
        if self.host.shards is None:  # a cluster's parts are cut from them: copied
            pool = yield from self.segment_pool(sum(sizes), deadline)
        segment = None
        if pool is not None:
            try:
                segment = Segment(layout(sizes)[1], pool.directory, pool.key)
            except OSError as exc:
                why = f"no room in /dev/shm for {sum(sizes)} bytes ({exc.strerror})"
                if self.host.shared_memory == "on":
                    raise SharedMemoryError(why) from None
                log.info("%s: these tensor buffers are not shared", why)
        bufs = TensorBuffers(group, dtype, shapes, segment)
        self.buffers_made.add(bufs)
        return bufs

    def buffers_of(self, arrays: Sequence[Any]) -> TensorBuffers | None:
        """The shared TensorBuffers of this client that ``arrays`` are, if any."""
        if not arrays:
            return None
        for bufs in list(self.buffers_made):
            if bufs.shared and bufs.is_these(arrays):
                return bufs
        return None

    def pull_into(
        self, request: pb.PullRequest, deadline: Deadline, bufs: TensorBuffers
    ) -> Op[tuple[int, list[Array]] | None]:
        """A pull of X written by the server straight into ``bufs`` (their arrays
        are the result); None when shared memory is not used for it."""
        pool = yield from self.segment_pool(bufs.nbytes, deadline)
        if pool is None:
            return None
        with bufs.claimed() as segment:
            msg = yield from _region_pull(self, request, segment, deadline)
            if msg.HasField("tensors_region") and bufs.holds(
                msg.tensors_region, msg.tensors
            ):
                return msg.update_count, list(bufs)
            if msg.HasField("tensors_region"):  # another layout: the group changed
                return msg.update_count, segment.read(msg.tensors_region, msg.tensors)
        return msg.update_count, _inline_copies(msg.tensors)


def _region_pull(
    link: SharedMemoryLink,
    request: pb.PullRequest,
    segment: Segment,
    deadline: Deadline,
) -> Op[Any]:
    """The unary Pull of ``request`` with its reply asked into ``segment``: the
    reply message (``tensors_region`` set when the server wrote there)."""
    req = pb.PullRequest()
    req.CopyFrom(request)
    req.reply_region.CopyFrom(segment.region())
    call = Call("Pull", unary_request(req), deadline, pull_waited(req))
    return (yield from link.guarded(one_call(call)))


def _inline_copies(tensors: Sequence[pb.Tensor]) -> list[Array]:
    """A reply's inline tensors as arrays of their own."""
    return [tensor_to_array(t, t.name).copy() for t in tensors]


def _region_push(
    link: SharedMemoryLink,
    req: pb.PushRequest,
    reply: Segment | None,
    deadline: Deadline,
    out: Sequence[Array] | None,
) -> Op[PushResult]:
    """The unary Push of a request whose gradients are named by region, resent
    like any push; X, when asked for, comes back through ``reply`` (or inline,
    without one or when the server answers inline)."""
    if reply is not None:
        req.reply_region.CopyFrom(reply.region())
    call = Call("Push", unary_request(req), deadline, pushed_what(req))
    resent = resending(call, req.group, req.seq, link.address)
    msg = yield from link.guarded(resent)
    values = None
    if req.return_values and reply is not None and msg.HasField("values_region"):
        values = reply.read(msg.values_region, msg.values, out=out)
    elif req.return_values:
        values = inline_values(msg, out)
    return PushResult(msg.update_count, msg.applied, msg.duplicate, values)


class SegmentTransport:
    """Gradients written into a segment of the pool, X (when asked for) written
    back by the server into the same segment over them (one segment a call, not
    two: the server steps element-wise, and a block of X replaces the block of
    gradients it has spent); a pull's reply written by the server into one."""

    def __init__(
        self, link: SharedMemoryLink, pool: SegmentPool, segs: list[Segment]
    ) -> None:
        self.link = link
        self.pool = pool
        self.segs = segs

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        req = pb.PushRequest()
        req.CopyFrom(template)
        req.gradients.extend(header_tensors(arrays))
        with released(self.pool, self.segs):
            req.gradients_region.CopyFrom(self.segs[0].write(list(arrays)))
            reply = self.segs[0] if req.return_values else None
            return (yield from _region_push(self.link, req, reply, deadline, out))

    def pull(
        self, request: pb.PullRequest, deadline: Deadline, out: Sequence[Array] | None
    ) -> Op[tuple[int, list[Array]] | None]:
        """A pull whose tensors come back in shared memory (inline when they no
        longer fit the segment, e.g. the group was replaced)."""
        seg = self.segs[0]
        with released(self.pool, self.segs):
            msg = yield from _region_pull(self.link, request, seg, deadline)
            if msg.HasField("tensors_region"):
                arrays = seg.read(msg.tensors_region, msg.tensors, out=out)
                return msg.update_count, arrays
        return msg.update_count, _inline_copies(msg.tensors)


class BufferTransport:
    """A push of ``TensorBuffers`` (gradients written in place in their segment):
    the unary Push names their region; X, when asked for, comes back through a
    segment of the pool. A pull into them has the server write X there (None:
    shared memory is not used for it)."""

    def __init__(
        self, link: SharedMemoryLink, pool: SegmentPool | None, bufs: TensorBuffers
    ) -> None:
        self.link = link
        self.pool = pool
        self.bufs = bufs

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        req = pb.PushRequest()
        req.CopyFrom(template)
        bufs = self.bufs
        req.gradients.extend(header_tensors(list(bufs)))
        with bufs.claimed() as segment:
            segs: list[Segment] = []
            if req.return_values:  # no room for the reply: X comes back inline
                segs = self.link.segments(self.pool, [bufs.nbytes], 1) or []
            with released(self.pool, segs):
                req.gradients_region.CopyFrom(bufs.publish(segment))
                reply = segs[0] if segs else None
                return (yield from _region_push(self.link, req, reply, deadline, out))

    def pull(
        self, request: pb.PullRequest, deadline: Deadline, out: Sequence[Array] | None
    ) -> Op[tuple[int, list[Array]] | None]:
        return (yield from self.link.pull_into(request, deadline, self.bufs))
