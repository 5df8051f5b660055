"""Ids tables on a cluster: each shard holds the ids it owns (no grpc of its own).

A group with ids tables on a cluster of N shards is N parts, ``"{group}#p{k}ofN"``
on the shard ranked k for the group (``_cluster.shard_ranking``), each an ordinary
group holding every ids table of the group, with the ids part k owns:

    owner(id) = splitmix64(id as uint64) mod N      (``initializers.splitmix64``)

A row push or pull is split by owner and goes only to the parts that own some of
its ids; their replies are put back in the caller's order. Each part counts its own
T: the row pushes that reached it (README, "Ids tables on a cluster"). Such a group
holds ids tables only (put dense tensors in a group of their own).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from . import _sharded
from ._client import Array, Client, GroupInfo, PushResult, _Deadline
from ._cluster import Layout, Part, fan_out, part_name, shard_ranking
from ._errors import AlreadyExistsError
from ._records import RowsPage
from .initializers import splitmix64

__all__ = [
    "create_group",
    "is_ids_layout",
    "list_rows",
    "owners",
    "pull_rows",
    "push_rows",
]


def owners(ids: Array, parts: int) -> Array:
    """The part that owns each id (see the module docstring)."""
    ids = np.asarray(ids, dtype=np.int64)
    return (splitmix64(ids.view(np.uint64)) % np.uint64(parts)).astype(np.int64)


def is_ids_layout(found: Layout) -> bool:
    """A group of ids tables split by id (no tensors, one part per shard)."""
    return not found.names and len(found.parts) > 1


def _plan(group: str, shards: int) -> Layout:
    ranking = shard_ranking(group, shards)
    parts = tuple(
        Part(part_name(group, k, shards), ranking[k], ()) for k in range(shards)
    )
    return Layout(group, (), (), parts)


def create_group(
    client: Client,
    req: pb.CreateGroupRequest,
    names: Sequence[str],
    table_arrays: Sequence[Sequence[Array]],
    deadline: _Deadline,
) -> GroupInfo:
    """Create the N parts (all, or none), each with the rows it owns."""
    group = req.group
    if names:
        raise ValueError(
            f"group {group!r} has ids tables: on a cluster such a group holds ids "
            f"tables only (its tensors {', '.join(names)} go in a group of their own)"
        )
    shards = client.shards or 1
    if _sharded._layout_of(group, _sharded._listing(client, group, deadline)):
        raise AlreadyExistsError(
            f"group {group!r} exists already in the cluster",
            reason="GROUP_EXISTS",
            metadata={"group": group},
        )
    planned = _plan(group, shards)
    own = [owners(t[0], shards) for t in table_arrays]

    def create(k: int) -> pb.GroupInfo:
        part = planned.parts[k]
        template = pb.CreateGroupRequest()
        template.CopyFrom(req)
        template.group = part.name
        mine = [[a[o == k] for a in t] for t, o in zip(table_arrays, own, strict=True)]
        op = client._create_op(template, [], [], [], deadline, table_arrays=mine)
        reply: pb.GroupInfo = client._run(op, part.shard)
        return reply

    first = create(0)  # the lock between two clients creating the group at once
    rest = [
        functools.partial(_sharded._attempt, functools.partial(create, k))
        for k in range(1, shards)
    ]
    results: list[pb.GroupInfo | BaseException] = [first, *fan_out(rest)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for part, r in zip(planned.parts, results, strict=True):
            if not isinstance(r, BaseException):
                _sharded._delete_quietly(client, part.shard, part.name, deadline)
        raise failed[0]
    infos = [r for r in results if isinstance(r, pb.GroupInfo)]
    _sharded._remember(client, planned, infos)
    return _sharded._merged(client, planned, infos)


def _split(
    selections: Mapping[str, Any], parts: int, with_rows: bool
) -> tuple[list[dict[str, Any]], dict[str, tuple[Array, Array]]]:
    """Per part: its share of each table's ids (and rows); per table: the owners
    and the ids as int64."""
    per_part: list[dict[str, Any]] = [{} for _ in range(parts)]
    routing: dict[str, tuple[Array, Array]] = {}
    for name, sel in selections.items():
        if with_rows:
            if not isinstance(sel, tuple):
                raise TypeError(
                    f"{name!r} is an ids table: its gradient is (ids, rows)"
                )
            ids, rows = np.asarray(sel[0]), np.asarray(sel[1])
        else:
            ids, rows = np.asarray(sel), None
        if ids.dtype.kind in "iu":
            ids = ids.astype(np.int64, copy=False)
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise TypeError(f"ids of {name!r} must be int64 of shape (k,)")
        own = owners(ids, parts)
        routing[name] = (own, ids)
        for k in np.unique(own).tolist():
            mask = own == k
            per_part[k][name] = (
                (ids[mask], rows[mask]) if rows is not None else ids[mask]
            )
    return per_part, routing


def push_rows(
    client: Client,
    found: Layout,
    gradients: Mapping[str, Any],
    base_version: int | None,
    learning_rate: float | None,
    deadline: _Deadline,
) -> PushResult:
    """A row push to the parts owning its ids (a push of no ids: to part 0)."""
    per_part, _ = _split(gradients, len(found.parts), with_rows=True)
    targets = [k for k, g in enumerate(per_part) if g] or [0]

    def push(k: int) -> PushResult:
        part = found.parts[k]
        op = client._rows_push_op(
            found.group, part.name, per_part[k], base_version, learning_rate, deadline
        )
        result: PushResult = client._run(op, part.shard)
        return result

    results = fan_out([functools.partial(push, k) for k in targets])
    return PushResult(
        min(r.update_count for r in results),
        all(r.applied for r in results),
        all(r.duplicate for r in results),
        None,
    )


def pull_rows(
    client: Client,
    found: Layout,
    selections: Mapping[str, Any],
    state: bool,
    min_version: int | None,
    deadline: _Deadline,
) -> dict[str, Array]:
    """Rows from the parts owning the ids, in the caller's order."""
    per_part, routing = _split(selections, len(found.parts), with_rows=False)
    targets = [k for k, s in enumerate(per_part) if s]
    if not targets:  # no ids: ask part 0 for empty rows (their shapes)
        targets, per_part[0] = [0], {n: ids for n, (_, ids) in routing.items()}

    def pull(k: int) -> dict[str, Array]:
        part = found.parts[k]
        op = client._rows_pull_op(
            found.group, part.name, per_part[k], state, min_version, deadline
        )
        rows: dict[str, Array] = client._run(op, part.shard)
        return rows

    replies = dict(
        zip(
            targets, fan_out([functools.partial(pull, k) for k in targets]), strict=True
        )
    )
    any_reply = next(iter(replies.values()))
    out: dict[str, Array] = {}
    for key, sample in any_reply.items():
        table = key.split(":", 1)[-1]
        own, ids = routing[table]
        rows = np.empty((ids.size, *sample.shape[1:]), sample.dtype)
        for k, reply in replies.items():
            if table in per_part[k]:
                rows[own == k] = reply[key]
        out[key] = rows
    return out


def list_rows(
    client: Client,
    found: Layout,
    table: str,
    page_token: str,
    page_size: int,
    values: bool,
    state: bool,
    deadline: _Deadline,
) -> RowsPage:
    """A page of ids ascending across every part: each part's page after the
    token, merged, cut at ``page_size``."""
    size = page_size or 1000

    def page(part: Part) -> RowsPage:
        op = client._list_rows_op(
            part.name, table, page_token, size, values, state, deadline
        )
        result: RowsPage = client._run(op, part.shard)
        return result

    pages = fan_out([functools.partial(page, p) for p in found.parts])
    ids = np.concatenate([p.ids for p in pages])
    order = np.argsort(ids, kind="stable")[:size]
    more = ids.size > size or any(p.next_page_token for p in pages)
    # a part that cut its page short bounds what is known to be complete
    bound = min(
        (int(p.ids[-1]) for p in pages if p.next_page_token and p.ids.size),
        default=None,
    )
    if bound is not None:
        order = order[ids[order] <= bound]
    rows = {k: np.concatenate([p.rows[k] for p in pages])[order] for k in pages[0].rows}
    taken = ids[order]
    token = str(int(taken[-1])) if more and taken.size else ""
    return RowsPage(
        taken,
        rows,
        token,
        sum(p.row_count for p in pages),
        min(p.update_count for p in pages),
    )
