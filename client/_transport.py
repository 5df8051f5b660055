"""One interface for every way a call's tensor bytes travel, and the one place that
chooses among them.

A ``TensorTransport`` carries one call: ``push`` sends its gradients (and brings X
back when asked for), ``pull`` brings back X (or X, V and H). Five classes implement
it, over four ways to move bytes:

- ``InlineTransport`` (``_grpc_transport``): bytes inside one unary message;
- ``StreamTransport`` (``_grpc_transport``): ~1 MiB chunks on a gRPC stream;
- ``SegmentTransport`` and ``BufferTransport`` (``_shm_transport``): segments in
  /dev/shm on one host, the unary message naming only their region;
- ``ChannelTransport`` (``_channel_transport``): one frame on a socket beside gRPC.

``choose_push`` and ``choose_pull`` pick one per call: shared memory where client and
server share a host and the call is large enough, else the data channel where the
server offers one, else gRPC (a stream above the stream threshold). Everything that is
not tensor bytes (validation, statuses, exactly-once, the WAL) stays on gRPC whatever
the transport; a transport that fails without the server saying why hands the call to
gRPC (a push with the same seq: applied once).

The long-lived state of a way (the shared-memory hello and segment pool, the data
channels per shard) lives in a *link* (``SharedMemoryLink``, ``DataChannelLink``)
that the client owns and closes; ``choose_*`` asks the links for a transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding

from ._grpc_transport import GrpcHost, grpc_transport
from ._ops import Deadline, Op
from ._records import PushResult

if TYPE_CHECKING:
    from ._channel_transport import DataChannelLink
    from ._shm_transport import SharedMemoryLink

__all__ = ["Pulled", "TensorTransport", "choose_pull", "choose_push"]

Array = np.ndarray[Any, Any]
Pulled = tuple[int, list[Array]]


class TensorTransport(Protocol):
    """One call's way for its tensor bytes (see the module's docstring)."""

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        """Push ``template`` (group, client_id, seq, return_values...) with these
        gradients, resent while unanswered; X lands in ``out`` where it fits."""
        ...

    def pull(
        self,
        request: pb.PullRequest,
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[Pulled | None]:
        """(T, arrays) of the pull ``request`` describes (into ``out`` where it
        fits); None when this way failed without the server saying why (the
        caller pulls over gRPC)."""
        ...


def choose_push(
    host: GrpcHost,
    shm: SharedMemoryLink,
    channels: DataChannelLink,
    arrays: Sequence[Any],
    return_values: bool,
    deadline: Deadline,
    shard: int = 0,
) -> Op[TensorTransport]:
    """The transport of one push of ``arrays`` (to ``shard`` of a cluster)."""
    sizes = [a.nbytes for a in arrays]
    # An encoded push (2-byte values, or a deferred encoding) does not go through
    # /dev/shm: its values would be encoded into the segment for nothing
    native = all(a.dtype.kind == "f" for a in arrays)
    via = yield from shm.push_transport(arrays, sizes, native, return_values, deadline)
    if via is not None:
        return via
    channel = yield from channels.transport(sum(sizes), deadline, shard)
    if channel is not None:  # native or encoded: the server widens as blocks land
        return channel
    return grpc_transport(host, sum(sizes))


def choose_pull(
    host: GrpcHost,
    shm: SharedMemoryLink,
    channels: DataChannelLink,
    segment_bytes: int,
    nbytes: int,
    encoding: Encoding,
    deadline: Deadline,
    shard: int = 0,
) -> Op[TensorTransport]:
    """The transport of one pull whose reply holds ``nbytes`` native bytes (0:
    unknown) and needs a segment of ``segment_bytes`` in shared memory."""
    if encoding == "native" and segment_bytes:
        via = yield from shm.pull_transport(nbytes, segment_bytes, deadline)
        if via is not None:
            return via
    wire = nbytes // 2 if encoding != "native" else nbytes  # 2 bytes an element
    channel = yield from channels.transport(wire, deadline, shard)
    if channel is not None:
        return channel
    return grpc_transport(host, nbytes)
