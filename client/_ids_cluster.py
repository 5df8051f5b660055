"""Ids tables on a cluster: each shard holds the ids it owns (no grpc of its own).

A group with ids tables on a cluster of N shards is N parts, ``"{group}#p{k}ofN"``
on the shard ranked k for the group (``_cluster.shard_ranking``), each an ordinary
group holding every ids table of the group, with the ids part k owns:

    owner(id) = splitmix64(id as uint64) mod N      (``initializers.splitmix64``)

A row push is split by owner (``split_push``) and lands as a split fixed table's
does (``_rowsplit.land``): every part is sent the push, with no rows when it owns
none of its ids, all with one (client_id, seq), so every part steps T once per push
and the cluster is bit-identical to one server (docs/embeddings.md).
A row pull asks only the parts that own some of its ids and puts their rows back in
the caller's order. Such a group holds ids tables only (put dense tensors in a group
of their own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding, encode
from onnxps.wire.initializers import splitmix64

from . import _sharded
from ._cluster import Layout, Part, part_name, shard_ranking
from ._errors import InvalidArgumentError
from ._ops import Deadline, Op, on_shard, parallel
from ._records import GroupInfo, RowsPage
from ._replies import as_indices
from ._shardops import ShardOps

Array = np.ndarray[Any, Any]

__all__ = [
    "create_group",
    "is_ids_layout",
    "list_rows",
    "owners",
    "pull_rows",
    "split_push",
]


def owners(ids: Array, parts: int) -> Array:
    """The part that owns each id (see the module docstring)."""
    ids = np.asarray(ids, dtype=np.int64)
    return (splitmix64(ids.view(np.uint64)) % np.uint64(parts)).astype(np.int64)


def is_ids_layout(found: Layout) -> bool:
    """A group of ids tables split by id (no tensors, one part per shard; on a
    cluster of one shard, its one part)."""
    return not found.names


def _plan(group: str, shards: int) -> Layout:
    ranking = shard_ranking(group, shards)
    parts = tuple(
        Part(part_name(group, k, shards), ranking[k], ()) for k in range(shards)
    )
    return Layout(group, (), (), parts)


def create_group(
    ops: ShardOps,
    req: pb.CreateGroupRequest,
    names: Sequence[str],
    table_arrays: Sequence[Sequence[Array]],
    deadline: Deadline,
) -> Op[GroupInfo]:
    """Create the N parts (all, or none), each with the rows it owns."""
    group = req.group
    if names:
        raise ValueError(
            f"group {group!r} has ids tables: on a cluster such a group holds ids "
            f"tables only (its tensors {', '.join(names)} go in a group of their own)"
        )
    shards = ops.placement_shards
    yield from _sharded.check_new(ops, group, deadline)
    planned = _plan(group, shards)
    own = [owners(t[0], shards) for t in table_arrays]

    def create(k: int) -> Op[pb.GroupInfo]:
        part = planned.parts[k]
        template = pb.CreateGroupRequest()
        template.CopyFrom(req)
        template.group = part.name
        mine = [[a[o == k] for a in t] for t, o in zip(table_arrays, own, strict=True)]
        op = ops.create(template, [], [], [], deadline, table_arrays=mine)
        return on_shard(part.shard, op)

    return (yield from _sharded.create_parts(ops, planned, create, deadline))


def _split(
    selections: Mapping[str, Any], parts: int
) -> tuple[list[dict[str, Array]], dict[str, tuple[Array, Array]]]:
    """Per part: its share of each table's ids; per table: the owners and the ids
    as int64."""
    per_part: list[dict[str, Array]] = [{} for _ in range(parts)]
    routing: dict[str, tuple[Array, Array]] = {}
    for name, sel in selections.items():
        ids = _ids(name, sel)
        own = owners(ids, parts)
        routing[name] = (own, ids)
        for k in np.unique(own).tolist():
            per_part[k][name] = ids[own == k]
    return per_part, routing


def split_push(
    ops: ShardOps,
    found: Layout,
    gradients: Mapping[str, Any],
    deadline: Deadline,
    encoding: Encoding = "native",
) -> Op[list[list[tuple[str, Array | None, Array]]]]:
    """Each part's row gradients: per table, the ids it owns and their rows (in
    the order they came, so repeats sum as on one server; none when it owns no
    id of the push), the rows in ``encoding``. What a part would refuse for its
    share alone (rows that do not match the ids, NaN or inf) is refused here,
    before any part is sent; the rest every part refuses alike."""

    count = len(found.parts)
    per_part: list[list[tuple[str, Array | None, Array]]] = [[] for _ in range(count)]
    finite = True
    for name, g in gradients.items():
        if not isinstance(g, tuple):
            raise TypeError(f"{name!r} is an ids table: its gradient is (ids, rows)")
        ids, rows = _ids(name, g[0]), np.asarray(g[1])
        if rows.ndim == 0 or rows.shape[0] != ids.size:
            raise InvalidArgumentError(
                f"gradient of ids table {name!r} must have one row per id: "
                f"{ids.size} ids, rows of shape {tuple(rows.shape)}",
                reason="SHAPE_MISMATCH",
                metadata={"group": found.group, "tensor": name},
            )
        if rows.dtype.kind in "fc":
            finite = finite and _sharded.all_finite(rows)
        rows = encode(rows, encoding, f"rows of {name!r}")
        own = owners(ids, count)
        for k in range(count):
            mask = own == k
            per_part[k].append((name, ids[mask], rows[mask]))
    yield from _sharded.check_finite(ops, found, finite, deadline)
    return per_part


def _ids(name: str, raw: Any) -> Array:
    ids = as_indices(raw, name)  # integers, exactly as int64
    if ids.ndim != 1:
        raise InvalidArgumentError(
            f"ids of {name!r} must be of shape (k,), got {ids.shape}",
            reason="ROW_INDICES",
            metadata={"tensor": name},
        )
    return ids


def pull_rows(
    ops: ShardOps,
    found: Layout,
    selections: Mapping[str, Any],
    state: bool,
    min_version: int | None,
    deadline: Deadline,
) -> Op[dict[str, Array]]:
    """Rows from the parts owning the ids, in the caller's order."""

    per_part, routing = _split(selections, len(found.parts))
    targets = [k for k, s in enumerate(per_part) if s]
    if not targets:  # no ids: ask part 0 for empty rows (their shapes)
        targets, per_part[0] = [0], {n: ids for n, (_, ids) in routing.items()}
    pulled = yield from parallel(
        [
            _sharded.pull_rows_part(
                ops, found, k, per_part[k], state, min_version, deadline
            )
            for k in targets
        ]
    )
    replies = dict(zip(targets, pulled, strict=True))
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
    ops: ShardOps,
    found: Layout,
    table: str,
    page_token: str,
    page_size: int,
    values: bool,
    state: bool,
    deadline: Deadline,
) -> Op[RowsPage]:
    """A page of ids ascending across every part: each part's page after the
    token, merged, cut at ``page_size``."""
    size = page_size or 1000

    def page(part: Part) -> Op[RowsPage]:
        op = ops.list_rows(part.name, table, page_token, size, values, state, deadline)
        return on_shard(ops.shard_of(part.name, part.shard), op)

    pages = yield from parallel([page(p) for p in found.parts])
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
