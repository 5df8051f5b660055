"""Where a cluster's group lives: its layout, found by listing every shard and kept
(``ShardOps.layouts``), the placement map's owners applied (docs/resharding.md),
and a call made again with a fresh layout when the one kept is stale (the group
recreated, or moved by a resharding: MOVED). Operations for both clients, used by
``_sharded`` and the modules beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import PROTO_TO_DTYPE

from ._cluster import Layout, LayoutError, base_name, layout_from_listing
from ._errors import FailedPreconditionError, NotFoundError, RpcError
from ._landing import follow_moved, is_moved, until_landed
from ._ops import Blocking, Call, Deadline, Op, on_shard, one_call, parallel, what
from ._shardops import ShardOps

__all__ = ["Listing", "layout", "rerouted"]

R = TypeVar("R")
Listing = list[tuple[int, pb.GroupInfo]]


def _shards(ops: ShardOps) -> int:
    assert ops.shards is not None
    return ops.shards


def _call(
    ops: ShardOps, method: str, req: Any, deadline: Deadline, shard: int
) -> Op[Any]:
    """One call to one shard, resent while the shard is unavailable (a restarting
    pod) or to the shard a MOVED answer names, until the deadline: the calls
    routed here are idempotent."""
    call = Call(method, lambda: req, deadline, what(method))
    name = getattr(req, "group", "")
    return until_landed(
        lambda: on_shard(ops.shard_of(name, shard) if name else shard, one_call(call)),
        deadline,
        ops=ops,
    )


def _listing(ops: ShardOps, prefix: str, deadline: Deadline) -> Op[Listing]:
    """Every shard's groups whose names start with ``prefix``, with their shard."""
    req = pb.ListGroupsRequest(prefix=prefix)
    replies = yield from parallel(
        [_call(ops, "ListGroups", req, deadline, i) for i in range(_shards(ops))]
    )
    return [(i, g) for i, msg in enumerate(replies) for g in msg.groups]


def _layout_of(
    group: str, listing: Listing, ops: ShardOps | None = None
) -> Layout | None:
    """The group's layout from the shards' listing; a name the placement map
    gives an owner (a resharding moved it, or moves it now) counts only there."""
    entries = [
        (i, g.name, [(t.name, list(t.dims)) for t in g.tensors])
        for i, g in listing
        if ops is None or ops.host.owner(g.name) in (None, i)
    ]
    try:
        return layout_from_listing(group, entries)
    except LayoutError as exc:
        raise FailedPreconditionError(
            str(exc), reason="CLUSTER_LAYOUT_BROKEN", metadata={"group": group}
        ) from None


def _not_found(group: str, shards: int) -> NotFoundError:
    return NotFoundError(
        f"group {group!r} does not exist on any of the {shards} shards",
        reason="GROUP_NOT_FOUND",
        metadata={"group": group},
    )


def layout(
    ops: ShardOps, group: str, deadline: Deadline, refresh: bool = False
) -> Op[Layout]:
    """The group's layout: remembered, or found by listing every shard."""
    found = None if refresh else ops.layouts.get(group)
    if found is not None:
        return found
    listing = yield from _listing(ops, group, deadline)
    try:
        found = _layout_of(group, listing, ops)
    except FailedPreconditionError:
        found = None  # held twice: a move flipped since the map was read
    if found is None:
        # a resharding may have moved it since this client read the map
        yield Blocking(ops.host.refresh_placement)
        listing = yield from _listing(ops, group, deadline)
        found = _layout_of(group, listing, ops)
    if found is None:
        ops.layouts.pop(group, None)
        raise _not_found(group, _shards(ops))
    _remember(ops, found, [g for _, g in listing])
    return found


def _remember(ops: ShardOps, found: Layout, infos: Sequence[pb.GroupInfo]) -> None:
    ops.layouts[found.group] = found
    for g in infos:
        dtype = PROTO_TO_DTYPE[g.dtype]
        ops.sizes[g.name] = g.element_count * dtype.itemsize
        ops.dtypes[g.name] = dtype
        shapes = [tuple(t.dims) for t in g.tensors]
        ops.remember_form(g.name, g.layout, dtype, shapes, g.tables)


def rerouted(
    ops: ShardOps,
    group: str,
    deadline: Deadline,
    call: Callable[[Layout], Op[R]],
) -> Op[R]:
    """``call(layout)``; again with a fresh layout when a remembered one is
    stale (the group was deleted, or recreated with another layout) or a shard
    answered MOVED (a resharding moved a part: the map is read again), within
    the deadline."""
    cached = group in ops.layouts
    while True:
        moved: RpcError | None = None
        try:
            return (yield from call((yield from layout(ops, group, deadline))))
        except NotFoundError:
            # a shard a MOVED answer named, where the move was then abandoned
            stale = [n for n in ops.moved if base_name(n)[0] == group]
            for n in stale:
                del ops.moved[n]
            if not (cached or stale) or deadline.remaining() <= 0:
                raise
            cached = False
            ops.layouts.pop(group, None)
        except FailedPreconditionError as exc:
            if not is_moved(exc) or deadline.remaining() <= 0:
                raise
            moved = exc
        if moved is not None:
            yield from follow_moved(ops, moved)
