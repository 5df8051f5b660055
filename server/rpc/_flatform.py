"""The flat form on the server's side of the wire (docs/protocol.md, "The flat
form"): a push or pull naming its group's layout digest carries the group's tensors
as ONE tensor. The transports (``_transports``) move that one tensor as any other;
these turn it into the group's tensors for the store (``flat_gradients``, views
the store steps as one array) and the store's X back into one array
(``flat_values``, ``FlatBlocks`` for X sent as the push steps)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ..store import PushOutcome, PushTicket
from ..store import ValuesSink as StoreSink
from ..store._flat import FlatArrays, FlatValues
from ._common import names_of

__all__ = [
    "FlatBlocks",
    "FlatEmitter",
    "flat_gradients",
    "flat_values",
    "gradient_names",
]

Array = np.ndarray[Any, Any]


class StreamedSink(StoreSink, Protocol):
    """A PushPullStream's sink (``_transports.FrameSink``) as the flat form uses
    it."""

    def lend(self, room: Sequence[Array], release: Callable[[], None]) -> None: ...

    def run(self, push: Callable[[], Any]) -> None: ...

    def frames(self) -> Iterator[Any]: ...

    def close(self) -> None: ...


def gradient_names(req: pb.PushRequest, ticket: PushTicket) -> list[str]:
    """How messages name a push's gradients: by the group's names, or the flat
    form's one gradient."""
    if req.layout:
        return [f"the flat gradient of the group's {len(ticket.names)} tensors"]
    return names_of("gradient", len(req.gradients), ticket.names)


def flat_gradients(ticket: PushTicket, grads: Sequence[Array]) -> FlatArrays:
    """A flat push's one gradient as the group's tensors, that the store steps
    as one array (``FlatArrays``): their views are made only where the store
    reads them per tensor (``FlatArrays.unviewed``)."""
    return FlatArrays.unviewed(grads[0].reshape(-1), ticket.shapes)


def flat_values(values: Sequence[Array]) -> list[Array]:
    """X of a flat push's reply: the flat buffer the store's per-tensor views are
    views of (``FlatValues``), joined if they are not."""
    if isinstance(values, FlatValues):
        return [values.flats[0]]
    return [np.concatenate([v.reshape(-1) for v in values])]


class FlatBlocks:
    """A store's ``ValuesSink`` that takes X in the flat form: the store's
    per-tensor blocks (``begin``, ``block``) handed to ``inner`` as blocks of the
    one flat X."""

    def __init__(self, inner: StoreSink, ticket: PushTicket) -> None:
        self.inner = inner
        self.offsets = ticket.offsets
        self.flat_x = ticket.flat_x

    def begin(self, outcome: PushOutcome, xs: Sequence[Array]) -> None:
        self.inner.begin(outcome, [self.flat_x])

    def block(self, index: int, start: int, stop: int) -> None:
        offset = self.offsets[index]
        self.inner.block(0, offset + start, offset + stop)


class FlatEmitter(FlatBlocks):
    """A PushPullStream's ``FrameSink`` that takes X in the flat form."""

    def __init__(self, inner: StreamedSink, ticket: PushTicket) -> None:
        super().__init__(inner, ticket)
        self.frame_sink = inner

    def lend(self, room: Sequence[Array], release: Callable[[], None]) -> None:
        flat = room.flat if isinstance(room, FlatArrays) else room[0]
        self.frame_sink.lend([flat], release)

    def run(self, push: Callable[[], Any]) -> None:
        self.frame_sink.run(push)

    def frames(self) -> Iterator[Any]:
        return self.frame_sink.frames()

    def close(self) -> None:
        self.frame_sink.close()
