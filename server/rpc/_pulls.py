"""The sinks of a pull's reply (``PullSink``), one per way its values travel:
inline in the reply (``InlinePull``), in chunks after a PullStream's header
(``StreamPull``), into the client's shared-memory segment (``RegionPull``), or as
one frame on the call's data channel (``ChannelPull``). The seam
(``_transports.Transports``) picks one from the request; a sink runs the pull
(``reply``), holding what it needs around it, and asks the store (``Pulled``) for
the values the way it sends them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    ENCODING_NAMES,
    DeferredEncoding,
    EncodedMessage,
    EncodingRangeError,
    chunk_frames,
    header_tensors,
)

from ..errors import FailedPrecondition, Unavailable
from ..interceptors.limits import InflightHold
from ..store import PullResult
from ..transports._datachannel import DataChannel
from ..transports._shm import Caller, SharedMemory

__all__ = [
    "ChannelPull",
    "InlinePull",
    "PullSink",
    "Pulled",
    "RegionPull",
    "ReplyBytes",
    "StreamPull",
    "deferred_values",
    "encoded_values",
]

Array = np.ndarray[Any, Any]


class Pulled(Protocol):
    """A pull's values, as its routine (``TensorRpcs``) reads them from the store."""

    def values(self, reserve: Callable[[int], None]) -> PullResult:
        """X (and the state) of the version asked for; ``reserve`` is handed the
        reply's bytes before they are read."""
        ...

    def into(
        self, write: Callable[[Sequence[Array], tuple[str, ...]], pb.PullResponse]
    ) -> tuple[int, float, pb.PullResponse]:
        """(T, R, ``write``'s reply): ``write`` copies the live values out under
        the group's lock."""
        ...


class PullSink(Protocol):
    def reply(self, pulled: Pulled) -> Any:
        """The pull's reply, its values sent the sink's way (a message; for a
        stream, an iterator of messages)."""
        ...


def _out_of_range(exc: EncodingRangeError, encoding: int) -> FailedPrecondition:
    name = ENCODING_NAMES[encoding]
    return FailedPrecondition(
        f"cannot pull as {name}: {exc}",
        reason="OUT_OF_ENCODING_RANGE",
        metadata={"encoding": name},
    )


def deferred_values(
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


def encoded_values(
    arrays: Sequence[Array], names: Sequence[str], encoding: int
) -> Sequence[Array]:
    """X in the pull's encoding (a known one, checked by the pull), encoded whole
    now."""
    try:
        return [
            a.encoded() if isinstance(a, DeferredEncoding) else a
            for a in deferred_values(arrays, names, encoding)
        ]
    except EncodingRangeError as exc:
        raise _out_of_range(exc, encoding) from None


ReplyBytes = Callable[[Any, bool], AbstractContextManager[InflightHold]]


class InlinePull:
    """X in the reply (joined when sent over gRPC; a frame call sends the arrays'
    bytes), counted in the in-flight budget until the call ends."""

    def __init__(self, encoding: int, hold: AbstractContextManager[InflightHold]):
        self.encoding = encoding
        self.hold = hold

    def reply(self, pulled: Pulled) -> Any:
        with self.hold as hold:
            out = pulled.values(functools.partial(hold.admit, what=_PULL_CARRIES))
            reply = pb.PullResponse(
                update_count=out.update_count, learning_rate=out.learning_rate
            )
            arrays = encoded_values(out.arrays, out.names, self.encoding)
            return EncodedMessage(reply, "tensors", arrays, out.names, defer=True)


_PULL_CARRIES = "this pull's reply carries"


class StreamPull:
    """X in ~1 MiB chunks after a PullStream's header."""

    def __init__(
        self,
        encoding: int,
        hold: AbstractContextManager[InflightHold],
        chunk_bytes: int,
    ) -> None:
        self.encoding = encoding
        self.hold = hold
        self.chunk_bytes = chunk_bytes

    def reply(self, pulled: Pulled) -> Iterator[Any]:
        with self.hold as hold:
            out = pulled.values(functools.partial(hold.admit, what=_PULL_CARRIES))
            arrays = encoded_values(out.arrays, out.names, self.encoding)
            header = pb.PullResponse(
                update_count=out.update_count,
                learning_rate=out.learning_rate,
                tensors=header_tensors(arrays, out.names),
            )
            yield pb.PullStreamResponse(header=header)
            yield from chunk_frames(pb.PullStreamResponse, arrays, self.chunk_bytes)


class RegionPull:
    """X written straight from the group into the client's reply segment (one
    copy, under the group's lock); in the reply (``fallback``) when it does not
    fit there."""

    def __init__(
        self,
        shm: SharedMemory,
        region: pb.SharedMemoryRegion,
        caller: Caller,
        fallback: PullSink,
        hold: AbstractContextManager[InflightHold] | None = None,
    ) -> None:
        self.shm = shm
        self.region = region
        self.caller = caller
        self.fallback = fallback
        self.hold: AbstractContextManager[InflightHold | None] = (
            hold if hold is not None else nullcontext(None)
        )

    def reply(self, pulled: Pulled) -> Any:
        # before the lock: the segment is usable, and what it maps is held in the
        # in-flight budget until the call ends
        nbytes = self.shm.check(self.region, self.caller, "reply_region")
        with self.hold as hold:
            if hold is not None:
                hold.admit(nbytes, what="this pull's shared-memory segment maps")
            try:
                t, lr, reply = pulled.into(self._write)
            finally:
                self.shm.finished(self.region)
        if not reply.HasField("tensors_region"):
            return self.fallback.reply(pulled)
        reply.update_count, reply.learning_rate = t, lr
        return reply

    def _write(
        self, arrays: Sequence[Array], names: tuple[str, ...]
    ) -> pb.PullResponse:
        region = self.shm.write(self.region, arrays, self.caller)
        reply = pb.PullResponse()
        if region is not None:
            reply.tensors_region.CopyFrom(region)
            reply.tensors.extend(header_tensors(arrays, names))
        return reply


class ChannelPull:
    """X as one frame on the call's data channel (encoded block by block when the
    pull asks for an encoding), after which the reply says so."""

    def __init__(
        self,
        channel: AbstractContextManager[tuple[DataChannel, float | None]],
        req: pb.PullRequest,
        hold: AbstractContextManager[InflightHold],
    ) -> None:
        self.channel = channel
        self.req = req
        self.hold = hold

    def reply(self, pulled: Pulled) -> pb.PullResponse:
        req = self.req
        with self.channel as (ch, deadline), self.hold as hold:
            out = pulled.values(functools.partial(hold.admit, what=_PULL_CARRIES))
            arrays = deferred_values(out.arrays, out.names, req.encoding)
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
                tensors=header_tensors(arrays, out.names),
                tensors_on_channel=True,
            )
