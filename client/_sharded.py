"""The ``Client``'s calls on a cluster: each one routed to the parts of its group.

Placement and layouts are ``_cluster``'s pure functions; this module turns one call
into calls of one shard each (``Client._call`` and the ``_*_one`` primitives with a
``shard``), runs them with ``fan_out`` and merges the replies.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from onnxps.v1 import parameter_server_pb2 as pb

from ._client import (
    Array,
    Client,
    GroupInfo,
    PartInfo,
    PushResult,
    _Deadline,
    _group_info,
    until_landed,
)
from ._client import (
    _PartPush as PartPush,
)
from ._cluster import (
    Layout,
    LayoutError,
    base_name,
    fan_out,
    join_arrays,
    layout_from_listing,
    part_arrays,
    plan_layout,
)
from ._encoding import Encoding
from ._errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from .codec import PROTO_TO_DTYPE

__all__ = [
    "create_group",
    "delete_group",
    "describe_group",
    "list_groups",
    "part_targets",
    "pull",
    "push",
    "set_learning_rate",
]

log = logging.getLogger("onnxps.client")
R = TypeVar("R")
Listing = list[tuple[int, pb.GroupInfo]]


def _shards(client: Client) -> int:
    assert client.shards is not None
    return client.shards


def _call(
    client: Client, method: str, req: Any, deadline: _Deadline, what: None, shard: int
) -> Any:
    """One call to one shard, resent while the shard is unavailable (a restarting
    pod), until the deadline: the calls routed here are idempotent."""
    return until_landed(
        functools.partial(client._call, method, req, deadline, what, shard), deadline
    )


def _listing(client: Client, prefix: str, deadline: _Deadline) -> Listing:
    """Every shard's groups whose names start with ``prefix``, with their shard."""
    req = pb.ListGroupsRequest(prefix=prefix)
    replies = fan_out(
        [
            functools.partial(_call, client, "ListGroups", req, deadline, None, i)
            for i in range(_shards(client))
        ]
    )
    return [(i, g) for i, msg in enumerate(replies) for g in msg.groups]


def _layout_of(group: str, listing: Listing) -> Layout | None:
    entries = [
        (i, g.name, [(t.name, list(t.dims)) for t in g.tensors]) for i, g in listing
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
    client: Client, group: str, deadline: _Deadline, refresh: bool = False
) -> Layout:
    """The group's layout: remembered, or found by listing every shard."""
    found = None if refresh else client._layouts.get(group)
    if found is not None:
        return found
    listing = _listing(client, group, deadline)
    found = _layout_of(group, listing)
    if found is None:
        client._layouts.pop(group, None)
        raise _not_found(group, _shards(client))
    _remember(client, found, [g for _, g in listing])
    return found


def _remember(client: Client, found: Layout, infos: Sequence[pb.GroupInfo]) -> None:
    client._layouts[found.group] = found
    for g in infos:
        itemsize = PROTO_TO_DTYPE[g.dtype].itemsize
        client._sizes[g.name] = g.element_count * itemsize


def _rerouted(
    client: Client, group: str, deadline: _Deadline, call: Callable[[Layout], R]
) -> R:
    """``call(layout)``; once more with a fresh layout when a remembered one is
    stale (the group was deleted, or recreated with another layout)."""
    cached = group in client._layouts
    try:
        return call(layout(client, group, deadline))
    except NotFoundError:
        if not cached:
            raise
    return call(layout(client, group, deadline, refresh=True))


def part_targets(
    client: Client, group: str, deadline: _Deadline
) -> list[tuple[int, str]]:
    """``(shard, name)`` of every part of ``group``."""
    return [(p.shard, p.name) for p in layout(client, group, deadline).parts]


def _merged(client: Client, found: Layout, infos: Sequence[pb.GroupInfo]) -> GroupInfo:
    """One GroupInfo for the whole group from its parts' (in part order)."""
    first = _group_info(infos[0])
    parts = tuple(
        PartInfo(
            p.name,
            p.shard,
            client.addresses[p.shard],
            int(g.update_count),
            int(g.element_count),
        )
        for p, g in zip(found.parts, infos, strict=True)
    )
    return dataclasses.replace(
        first,
        name=found.group,
        tensors=list(zip(found.names, found.shapes, strict=True)),
        update_count=min(p.update_count for p in parts),
        element_count=sum(p.element_count for p in parts),
        state_bytes=sum(int(g.state_bytes) for g in infos),
        parts=parts,
        tables={  # an ids table split by id (``_ids_cluster``): its rows summed
            name: dataclasses.replace(
                t, row_count=sum(_group_info(g).tables[name].row_count for g in infos)
            )
            for name, t in first.tables.items()
        },
    )


# -- groups ---------------------------------------------------------------------------
def create_group(
    client: Client,
    req: pb.CreateGroupRequest,
    names: Sequence[str],
    arrays: Sequence[Array],
    state_arrays: Sequence[Array],
    deadline: _Deadline,
) -> GroupInfo:
    """Create the group's parts on their shards (all, or none: a part that could
    not be created makes the others be deleted again). The check that the group
    is new is a courtesy; part 0's creation is what decides between two clients."""
    group = req.group
    if _layout_of(group, _listing(client, group, deadline)) is not None:
        raise AlreadyExistsError(
            f"group {group!r} exists already in the cluster",
            reason="GROUP_EXISTS",
            metadata={"group": group},
        )
    dtype = arrays[0].dtype if arrays else None
    itemsize = dtype.itemsize if dtype is not None else 4
    shapes = [a.shape for a in arrays]
    planned = plan_layout(
        group, names, shapes, itemsize, _shards(client), client.split_bytes
    )

    def create(k: int) -> pb.GroupInfo:
        part = planned.parts[k]
        template = pb.CreateGroupRequest()
        template.CopyFrom(req)
        template.group = part.name
        return client._create_request(
            part.shard,
            template,
            planned.slot_names(part),
            part_arrays(planned, part, arrays),
            part_arrays(planned, part, state_arrays),
            deadline,
        )

    # Part 0 first: it is the lock between clients creating the same group at
    # once (the loser gets ALREADY_EXISTS there and leaves the winner's parts alone).
    first = create(0)
    rest = [
        functools.partial(_attempt, functools.partial(create, k))
        for k in range(1, len(planned.parts))
    ]
    results: list[pb.GroupInfo | BaseException] = [first, *fan_out(rest)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for part, r in zip(planned.parts, results, strict=True):
            if not isinstance(r, BaseException):
                _delete_quietly(client, part.shard, part.name, deadline)
        raise failed[0]
    infos = [r for r in results if isinstance(r, pb.GroupInfo)]
    _remember(client, planned, infos)
    return _merged(client, planned, infos)


def _attempt(call: Callable[[], R]) -> R | BaseException:
    try:
        return call()
    except Exception as exc:  # reported by the caller, after every part answered
        return exc


def _delete_quietly(client: Client, shard: int, name: str, deadline: _Deadline) -> None:
    try:
        client._call(
            "DeleteGroup", pb.DeleteGroupRequest(group=name), deadline, None, shard
        )
    except Exception as exc:  # the error that made us undo is the one to report
        log.warning("could not delete part %s on shard %d again: %s", name, shard, exc)


def _describe_parts(
    client: Client, found: Layout, deadline: _Deadline
) -> list[pb.GroupInfo]:
    replies = fan_out(
        [
            functools.partial(
                _call,
                client,
                "DescribeGroup",
                pb.DescribeGroupRequest(group=p.name),
                deadline,
                None,
                p.shard,
            )
            for p in found.parts
        ]
    )
    return [m.group for m in replies]


def describe_group(client: Client, group: str, deadline: _Deadline) -> GroupInfo:
    def describe(found: Layout) -> GroupInfo:
        return _merged(client, found, _describe_parts(client, found, deadline))

    return _rerouted(client, group, deadline, describe)


def list_groups(client: Client, prefix: str, deadline: _Deadline) -> list[GroupInfo]:
    """The groups of every shard, a split group once (its parts merged), by name."""
    listing = _listing(client, prefix, deadline)
    bases = sorted({base_name(g.name)[0] for _, g in listing})
    out = []
    for group in bases:
        if not group.startswith(prefix):
            continue
        mine = [(i, g) for i, g in listing if base_name(g.name)[0] == group]
        found = _layout_of(group, mine)
        assert found is not None
        by_name = {g.name: g for _, g in mine}
        infos = [by_name[p.name] for p in found.parts]
        _remember(client, found, infos)
        out.append(_merged(client, found, infos))
    return out


def delete_group(client: Client, group: str, deadline: _Deadline) -> bool:
    try:
        found = layout(client, group, deadline, refresh=True)
    except NotFoundError:
        return False
    client._layouts.pop(group, None)
    replies = fan_out(
        [
            functools.partial(
                _call,
                client,
                "DeleteGroup",
                pb.DeleteGroupRequest(group=p.name),
                deadline,
                None,
                p.shard,
            )
            for p in found.parts
        ]
    )
    for p in found.parts:
        client._sizes.pop(p.name, None)
    return any(m.deleted for m in replies)


def set_learning_rate(
    client: Client, group: str, learning_rate: float, deadline: _Deadline
) -> GroupInfo:
    def set_all(found: Layout) -> GroupInfo:
        replies = fan_out(
            [
                functools.partial(
                    _call,
                    client,
                    "SetLearningRate",
                    pb.SetLearningRateRequest(
                        group=p.name, learning_rate=learning_rate
                    ),
                    deadline,
                    None,
                    p.shard,
                )
                for p in found.parts
            ]
        )
        return _merged(client, found, [m.group for m in replies])

    return _rerouted(client, group, deadline, set_all)


# -- push and pull --------------------------------------------------------------------
def _check_gradients(found: Layout, arrays: Sequence[Array]) -> None:
    """Refused here, before any part is sent, so parts never disagree about it."""
    if len(arrays) != len(found.names):
        raise InvalidArgumentError(
            f"group {found.group!r} has {len(found.names)} tensors; the push gave "
            f"{len(arrays)} gradients",
            reason="WRONG_TENSOR_COUNT",
            metadata={"group": found.group},
        )
    for name, shape, a in zip(found.names, found.shapes, arrays, strict=True):
        if tuple(a.shape) != shape:
            raise InvalidArgumentError(
                f"gradient of {name!r} in group {found.group!r} has shape "
                f"{tuple(a.shape)}, expected {shape}",
                reason="WRONG_SHAPE",
                metadata={"group": found.group, "tensor": name},
            )


def _land(
    client: Client,
    group: str,
    parts: Sequence[PartPush],
    after: Sequence[PartPush],
    deadline: _Deadline,
) -> list[Any]:
    """Send ``parts`` in parallel, then (when they all landed) ``after``; replies in
    that order. A part that did not land for want of a shard or of time may or may
    not have been applied: it is remembered, with what comes after it, and the next
    push to ``group`` sends it first with the same seq (exactly once), so parts
    never stay a push apart."""

    def send(part: PartPush) -> Any:
        shard, req, grads = part
        return until_landed(
            functools.partial(client._push_one, shard, req, grads, deadline), deadline
        )

    results = fan_out(
        [functools.partial(_attempt, functools.partial(send, p)) for p in parts]
    )
    failed = [
        (p, r)
        for p, r in zip(parts, results, strict=True)
        if isinstance(r, BaseException)
    ]
    if failed:
        unsure = [
            p
            for p, r in failed
            if isinstance(r, UnavailableError | DeadlineExceededError)
        ]
        if unsure:
            client._unfinished[group] = (unsure, list(after))
        raise failed[0][1]
    if not after:
        return results
    return [*results, *_land(client, group, after, (), deadline)]


def _finish_earlier(client: Client, group: str, deadline: _Deadline) -> None:
    """Send what an earlier push to ``group`` left unsent (same seqs)."""
    unfinished = client._unfinished.pop(group, None)
    if unfinished is not None:
        log.info("push to %s: sending the parts an earlier push left first", group)
        try:
            _land(client, group, unfinished[0], unfinished[1], deadline)
        except FailedPreconditionError:
            pass  # part 0 refused it (stale): no part applied it, nothing is left


def push(
    client: Client, req: pb.PushRequest, arrays: Sequence[Array], deadline: _Deadline
) -> PushResult:
    _finish_earlier(client, req.group, deadline)

    def push_all(found: Layout) -> list[Any]:
        if found.split:
            _check_gradients(found, arrays)

        def part(k: int, base_version: bool) -> PartPush:
            p = found.parts[k]
            part_req = pb.PushRequest()
            part_req.CopyFrom(req)
            part_req.group = p.name
            if not base_version:
                part_req.ClearField("base_version")
            return p.shard, part_req, part_arrays(found, p, arrays)

        count = len(found.parts)
        if count > 1 and req.HasField("base_version"):
            # Part 0 alone decides whether the push is too stale; the others then
            # take it unconditionally, so no part refuses what another applied.
            rest = [part(k, False) for k in range(1, count)]
            return _land(client, req.group, [part(0, True)], rest, deadline)
        parts = [part(k, True) for k in range(count)]
        return _land(client, req.group, parts, (), deadline)

    replies = _rerouted(client, req.group, deadline, push_all)
    found = client._layouts[req.group]
    counts = {int(m.update_count) for m in replies}
    if len(counts) > 1:
        log.debug("push to %s: parts answered T=%s", req.group, sorted(counts))
    values = None
    if req.return_values:
        values = join_arrays(found, [m.values for m in replies])
    return PushResult(
        max(counts),
        all(m.applied for m in replies),
        all(m.duplicate for m in replies),
        values,
    )


def pull(
    client: Client,
    group: str,
    state: bool,
    min_version: int | None,
    deadline: _Deadline,
    encoding: Encoding = "native",
) -> tuple[int, list[Array]]:
    def pull_all(found: Layout) -> list[tuple[int, list[Array]]]:
        return fan_out(
            [
                functools.partial(
                    until_landed,
                    functools.partial(
                        client._pull_one,
                        p.shard,
                        p.name,
                        state,
                        min_version,
                        deadline,
                        encoding,
                    ),
                    deadline,
                )
                for p in found.parts
            ]
        )

    replies = _rerouted(client, group, deadline, pull_all)
    found = client._layouts[group]
    t = min(r[0] for r in replies)
    return t, join_arrays(found, [r[1] for r in replies])
