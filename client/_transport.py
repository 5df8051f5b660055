"""The client's one transport seam: a call's tensor bytes handed to one way of
moving them, chosen in one place, with the fallback inside.

A ``TensorTransport`` carries one call: ``push`` sends its gradients (and brings X
back when asked for), ``pull`` brings back X (or X, V and H); either answers None
when its way failed without the server saying why (the seam hands the call to the
next way: a push with the same seq, applied once). The ways:

- ``InlineTransport`` (``_grpc_transport``): bytes inside one unary message;
- ``FrameTransport`` (``_frames``): that unary message as a frame on a call
  channel beside gRPC (``frames="on"``), over gRPC where no frame can go;
- ``StreamTransport`` (``_grpc_transport``): ~1 MiB chunks on a gRPC stream;
- ``SegmentTransport`` and ``BufferTransport`` (``_shm_transport``): segments in
  /dev/shm on one host, the unary message naming only their region;
- ``ChannelTransport`` (``_channel_transport``): one frame on a socket beside gRPC.

``plan`` is the choice: from a call's shape (``CallShape``: its kind, bytes,
tensor count, shard, whether its bytes are native, its reply's segment, shared
buffers) and what the client allows and the server offered, the ways to try, best
first: shared memory where client and server share a host and the call is large
enough, else the data channel where the server offers one, else gRPC (a stream
above the stream threshold, a frame where the server offers a call channel).
The last way is gRPC's, which never passes a call on; create and apply (whose
tensors the server takes only inside their messages) are planned unary or
streamed, rows always streamed. Everything that is not tensor bytes (validation,
statuses, exactly-once, the WAL) stays on gRPC whatever the way.

The long-lived state of a way (the shared-memory hello and segment pool, the data
channels and call channels per shard) lives in a *link* (``SharedMemoryLink``,
``DataChannelLink``, ``CallChannelLink``) that ``Transports`` owns and closes. Both
drivers (``Client``, ``AsyncClient``) run what the seam yields.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ._channel_transport import (
    DATA_CHANNEL_THRESHOLD_BYTES,
    ChannelHost,
    DataChannelLink,
)
from ._frames import CallChannel, CallChannelLink, FrameTransport
from ._grpc_transport import GrpcHost, InlineTransport, StreamTransport
from ._ops import Deadline, Op
from ._records import PushResult
from ._shm_transport import (
    SHARED_MEMORY_THRESHOLD_BYTES,
    BufferTransport,
    SharedMemoryLink,
    ShmHost,
)
from .shm import TensorBuffers

__all__ = [
    "FRAMED_SHARED_MEMORY_THRESHOLD_BYTES",
    "CallShape",
    "Pulled",
    "TensorTransport",
    "Transports",
    "Way",
    "plan",
    "use_stream",
]

Array = np.ndarray[Any, Any]
Pulled = tuple[int, list[Array]]
Way = Literal["buffers", "shm", "channel", "stream", "frame", "inline"]
# Where frame calls may go, shared memory takes calls of this or more (``plan``):
# a frame's request holds at most FRAME_MAX_REQUEST_BYTES (1 MiB), headers included
FRAMED_SHARED_MEMORY_THRESHOLD_BYTES = 960 << 10


class TensorTransport(Protocol):
    """One call's way for its tensor bytes (see the module's docstring)."""

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult | None]:
        """Push ``template`` (group, client_id, seq, return_values...) with these
        gradients, resent while unanswered; X lands in ``out`` where it fits.
        None: this way failed without the server saying why (the next way
        sends it, with the same seq)."""
        ...

    def pull(
        self,
        request: pb.PullRequest,
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[Pulled | None]:
        """(T, arrays) of the pull ``request`` describes (into ``out`` where it
        fits); None when this way failed without the server saying why, or did
        not serve it (the next way pulls)."""
        ...


@dataclass(frozen=True, slots=True)
class CallShape:
    """What the choice reads of one call."""

    kind: Literal["push", "pull", "create", "apply", "rows"]
    nbytes: int  # tensor bytes in the group's dtype (a pull's: 0 when unknown)
    wire_bytes: int  # tensor bytes on the wire (2 an element when encoded)
    tensors: int
    shard: int = 0
    native: bool = True  # bytes in the group's dtype: shared memory may carry them
    return_values: bool = False
    segment_bytes: int = 0  # a pull's reply in shared memory needs this segment
    buffers: TensorBuffers | None = None  # a pull into this client's shared buffers
    frames_refused: bool = False  # the server refused a call channel lately


class SeamHost(ChannelHost, ShmHost, Protocol):
    """What the choice reads from its client, live (a client's settings may be
    changed between calls)."""

    frames: bool


def use_stream(host: GrpcHost, nbytes: int) -> bool:
    """Whether a call of ``nbytes`` tensor bytes over gRPC goes on a stream."""
    if host.transport == "auto":
        return nbytes > host.stream_threshold_bytes
    return host.transport == "stream"


def _offered(mode: str, auto: bool, nbytes: int, threshold: int) -> bool:
    """A way set to ``mode`` ("auto", "on", "off") serves a call of ``nbytes``."""
    return mode == "on" or (mode == "auto" and auto and nbytes >= threshold)


def plan(shape: CallShape, host: SeamHost) -> tuple[Way, ...]:
    """The ways to try for a call of ``shape``, best first; the last is gRPC's.

    By cost (``benchmarks/paths.py``, one tensor's push + pull on one host, 5
    rounds): a frame call takes 0.68 ms at 4 KiB, 0.90 at 256 KiB, 1.00 at 512
    KiB and 1.07 at 768 KiB, against 1.83-2.00 ms for shared memory; a call of 1
    MiB does not fit a frame (gRPC: 3.3 ms), and shared memory takes it in 2.4.
    So where frames may go, shared memory takes calls from
    ``FRAMED_SHARED_MEMORY_THRESHOLD_BYTES``, else from
    ``SHARED_MEMORY_THRESHOLD_BYTES``."""
    if shape.kind == "rows":  # PushRows and PullRows are client streams
        return ("stream",)
    if shape.kind != "push" and shape.kind != "pull":
        # create and apply: the server takes their tensors inside their messages
        return ("stream",) if use_stream(host, shape.nbytes) else ("inline",)
    ways: list[Way] = []
    auto = host.transport == "auto"
    shm = host.shared_memory
    framed = host.frames and not shape.frames_refused
    threshold = (
        FRAMED_SHARED_MEMORY_THRESHOLD_BYTES
        if framed
        else SHARED_MEMORY_THRESHOLD_BYTES
    )
    if shape.buffers is not None and _offered(
        shm, auto, shape.buffers.nbytes, SHARED_MEMORY_THRESHOLD_BYTES
    ):
        ways.append("buffers")
    if (
        shape.native
        and (shape.kind == "push" or shape.segment_bytes)
        and _offered(shm, auto, shape.nbytes, threshold)
    ):
        ways.append("shm")
    if host.TRANSFERS and _offered(
        host.data_channel, auto, shape.wire_bytes, DATA_CHANNEL_THRESHOLD_BYTES
    ):
        ways.append("channel")
    if use_stream(host, shape.nbytes):
        ways.append("stream")
    else:
        ways.append("frame" if framed else "inline")
    return tuple(ways)


class Transports:
    """The ways of one client's calls to each server (a cluster: each shard), the
    links they keep, and the one place a call is handed to its way."""

    def __init__(
        self,
        host: SeamHost,
        tls: tuple[bytes | None, bytes | None, bytes | None],
        server_name_override: str | None,
        dtypes: dict[str, np.dtype[Any]],
        follows: bool = False,
    ) -> None:
        """``follows``: the client follows a replicated cluster's primaries."""
        self.host = host
        self.shm_links: dict[int, SharedMemoryLink] = {}
        self.channels = DataChannelLink(host, tls, server_name_override, dtypes)
        self.calls = CallChannelLink(
            host.addresses, self._tls_context, server_name_override, follows
        )
        self._inline = InlineTransport(host)
        self._stream = StreamTransport(host)
        self._frames: dict[int, FrameTransport] = {}  # per shard

    def _tls_context(self) -> ssl.SSLContext | None:
        return self.channels.context()

    def shm(self, shard: int = 0) -> SharedMemoryLink:
        """The shared-memory link with ``shard`` (0: the one server)."""
        link = self.shm_links.get(shard)
        if link is None:
            link = self.shm_links.setdefault(shard, SharedMemoryLink(self.host, shard))
        return link

    @property
    def call_channels(self) -> dict[int, CallChannel]:
        return self.calls.channels

    def streams(self, kind: Literal["create", "apply"], nbytes: int, n: int) -> bool:
        """Whether a ``kind`` call of ``n`` tensors, ``nbytes`` bytes, whose tensors
        travel inside its gRPC messages, sends them on a stream (the plan's)."""
        return plan(CallShape(kind, nbytes, nbytes, n), self.host) == ("stream",)

    def close(self, *, closing_client: bool) -> None:
        """Close the channels and unlink the segments (``closing_client``: the
        client's tensor buffers too)."""
        self.channels.close()
        self.calls.close()
        for link in self.shm_links.values():
            link.close(closing_client=closing_client)

    # -- the seam ------------------------------------------------------------------
    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
        shard: int = 0,
    ) -> Op[PushResult]:
        """Push ``arrays`` with ``template`` to ``shard`` on the first way of its
        plan that takes it.

        The plan is made now, when the op is made. A plan of one way (gRPC's)
        hands back that way's op itself: the seam chose, and stays out of the
        call's stack while it runs (each step of the op goes straight to it)."""
        nbytes = sum(a.nbytes for a in arrays)
        # An encoded push (2-byte values, or a deferred encoding) does not go
        # through /dev/shm: its values would be encoded into the segment for nothing
        native = all(a.dtype.kind == "f" for a in arrays)
        shape = CallShape(
            "push",
            nbytes,
            nbytes,
            len(arrays),
            shard,
            native,
            template.return_values,
            # (asked only where frames may go: a call channel is never opened else)
            frames_refused=self.host.frames and self.calls.refused(shard),
        )
        ways = plan(shape, self.host)
        if len(ways) == 1:
            return self._grpc(ways[0], shard).push(template, arrays, deadline, out)
        return self._push_ways(ways, shape, template, arrays, deadline, out)

    def _push_ways(
        self,
        ways: tuple[Way, ...],
        shape: CallShape,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        """Try ``ways`` in order; the last (gRPC's) never passes the push on."""
        shard = shape.shard
        for name in ways[:-1]:
            way = yield from self._way(name, shape, arrays, deadline)
            if way is not None:
                pushed = yield from way.push(template, arrays, deadline, out)
                if pushed is not None:
                    return pushed
        last = self._grpc(ways[-1], shard)
        result: PushResult = yield from last.push(template, arrays, deadline, out)
        return result

    def pull(
        self,
        request: pb.PullRequest,
        shape: CallShape,
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[Pulled]:
        """The pull of ``request`` on the first way of its plan that serves it
        (planned now; a plan of one way hands back that way's op, as ``push``)."""
        if self.host.frames and self.calls.refused(shape.shard):
            shape = dataclasses.replace(shape, frames_refused=True)
        ways = plan(shape, self.host)
        if len(ways) == 1:
            return self._grpc(ways[0], shape.shard).pull(request, deadline, out)
        return self._pull_ways(ways, shape, request, deadline, out)

    def _pull_ways(
        self,
        ways: tuple[Way, ...],
        shape: CallShape,
        request: pb.PullRequest,
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[Pulled]:
        """Try ``ways`` in order; the last (gRPC's) always serves the pull."""
        for name in ways[:-1]:
            way = yield from self._way(name, shape, (), deadline)
            if way is not None:
                pulled = yield from way.pull(request, deadline, out)
                if pulled is not None:
                    return pulled
        last = self._grpc(ways[-1], shape.shard)
        result: Pulled = yield from last.pull(request, deadline, out)
        return result

    def _grpc(self, name: Way, shard: int) -> InlineTransport | StreamTransport:
        if name == "stream":
            return self._stream
        if name != "frame":
            return self._inline
        way = self._frames.get(shard)
        if way is None:
            way = self._frames[shard] = FrameTransport(self.host, self.calls, shard)
        return way

    def _way(
        self, name: Way, shape: CallShape, arrays: Sequence[Any], deadline: Deadline
    ) -> Op[TensorTransport | None]:
        """The transport ``name`` for this call, or None (its link says no)."""
        shard = shape.shard
        if name == "channel":
            return (
                yield from self.channels.transport(shape.wire_bytes, deadline, shard)
            )
        link = self.shm(shard)
        if name == "buffers" and shape.buffers is not None:
            return BufferTransport(link, None, shape.buffers)
        if shape.kind == "push":
            sizes = [a.nbytes for a in arrays]
            return (
                yield from link.push_transport(
                    arrays, sizes, shape.native, shape.return_values, deadline
                )
            )
        return (
            yield from link.pull_transport(shape.nbytes, shape.segment_bytes, deadline)
        )
