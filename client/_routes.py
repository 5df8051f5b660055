"""Where a client's calls go: one server, or the parts of each group on the shards
of a cluster. A client holds one ``Route``, chosen when it is made (``route_of``),
and every operation that depends on where a group lives asks it: the routing is a
wrapper around the per-shard operations (``ShardOps``, called through its public
methods), written once for both clients, not a second copy of each of them.

- ``OneServer``: every call to the one address;
- ``Cluster``: each call to the parts of its group (``_sharded``: dense groups,
  split or whole; ``_rowsplit``: row calls on split groups; ``_ids_cluster``: groups
  with ids tables).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding

from . import _ids_cluster, _rowsplit, _sharded
from ._errors import InvalidArgumentError
from ._ops import Deadline, Op, on_shard, unary_call
from ._records import (
    GroupInfo,
    HistoryInfo,
    HistoryStep,
    LeaseInfo,
    PushResult,
    RewindInfo,
    RowsPage,
    SaveInfo,
    group_info,
    history_info,
    lease_info,
    rewind_info,
)
from ._shardops import ShardOps

__all__ = ["Cluster", "OneServer", "Route", "Targets", "route_of"]

Array = np.ndarray[Any, Any]
# (shard, name on it) of each part of a group
Targets = list[tuple[int, str]]


def _refused(exc: Exception | None) -> Op[Any]:
    """An operation that raises ``exc`` when it runs."""
    if exc is not None:
        raise exc
    yield from ()


def route_of(ops: ShardOps) -> OneServer | Cluster:
    """The route of a client: a cluster when it was given a list of addresses."""
    return OneServer(ops) if ops.shards is None else Cluster(ops)


class OneServer:
    """Every call to the client's one server."""

    def __init__(self, ops: ShardOps) -> None:
        self.ops = ops
        # a push goes straight to the transport seam (its own arguments)
        self.push = ops.push

    def create(
        self,
        req: pb.CreateGroupRequest,
        names: list[str],
        arrays: list[Array],
        state_arrays: list[Array],
        deadline: Deadline,
        table_arrays: Sequence[Sequence[Array]],
    ) -> Op[GroupInfo]:
        msg = yield from self.ops.create(
            req, names, arrays, state_arrays, deadline, table_arrays=table_arrays
        )
        return self.ops.remember(group_info(msg))

    def describe(self, name: str, deadline: Deadline) -> Op[GroupInfo]:
        return self.ops.describe(name, deadline)

    def list_groups(self, prefix: str, deadline: Deadline) -> Op[list[GroupInfo]]:
        req = pb.ListGroupsRequest(prefix=prefix)
        msg = yield from unary_call("ListGroups", req, deadline)
        return [group_info(g) for g in msg.groups]

    def delete(self, name: str, deadline: Deadline) -> Op[bool]:
        req = pb.DeleteGroupRequest(group=name)
        msg = yield from unary_call("DeleteGroup", req, deadline)
        return bool(msg.deleted)

    def set_learning_rate(
        self, name: str, learning_rate: float, deadline: Deadline
    ) -> Op[GroupInfo]:
        req = pb.SetLearningRateRequest(group=name, learning_rate=learning_rate)
        msg = yield from unary_call("SetLearningRate", req, deadline)
        return group_info(msg.group)

    def pull(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding,
        out: Sequence[Array] | None,
        allow_apart: bool,
    ) -> Op[tuple[int, list[Array]]]:
        return self.ops.pull(group, state, min_version, deadline, encoding, out)

    def save(self, deadline: Deadline) -> Op[SaveInfo]:
        msg = yield from unary_call("Save", pb.SaveRequest(), deadline)
        return SaveInfo(msg.path, msg.groups, msg.bytes)

    def rewind(self, group: str, to_step: int, deadline: Deadline) -> Op[RewindInfo]:
        req = pb.RewindRequest(group=group, to_step=to_step)
        msg = yield from unary_call("Rewind", req, deadline)
        return rewind_info(msg, group_info(msg.group), int(msg.from_step))

    def fork(
        self, group: str, new_group: str, at_step: int, deadline: Deadline
    ) -> Op[RewindInfo]:
        req = pb.ForkRequest(group=group, new_group=new_group, at_step=at_step)
        msg = yield from unary_call("Fork", req, deadline)
        info = self.ops.remember(group_info(msg.group))
        return rewind_info(msg, info, int(msg.from_step))

    def history(self, group: str, deadline: Deadline) -> Op[HistoryInfo]:
        # a long history comes in pages (each under gRPC's message limit)
        steps: list[HistoryStep] = []
        start = 0
        while True:
            req = pb.HistoryRequest(
                group=group, start_step=start, limit=_sharded.HISTORY_PAGE
            )
            msg = yield from unary_call("History", req, deadline)
            info = history_info(msg)
            steps += info.steps
            if not msg.more or not info.steps:
                return replace(info, steps=steps)
            start = info.steps[-1].step + 1

    def push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        base_version: int | None,
        learning_rate: float | None,
        deadline: Deadline,
        encoding: Encoding,
    ) -> Op[PushResult]:
        return self.ops.push_rows(
            group, group, gradients, base_version, learning_rate, deadline, encoding
        )

    def pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        state: bool,
        min_version: int | None,
        deadline: Deadline,
    ) -> Op[dict[str, Array]]:
        return self.ops.pull_rows(
            group, group, selections, state, min_version, deadline
        )

    def list_rows(
        self,
        group: str,
        table: str,
        page_token: str,
        page_size: int,
        values: bool,
        state: bool,
        deadline: Deadline,
    ) -> Op[RowsPage]:
        return self.ops.list_rows(
            group, table, page_token, page_size, values, state, deadline
        )

    def join(
        self, group: str, worker_id: str, deadline: Deadline
    ) -> Op[tuple[Targets, LeaseInfo]]:
        req = pb.JoinGroupRequest(group=group, worker_id=worker_id)
        return [(0, group)], lease_info(
            (yield from unary_call("JoinGroup", req, deadline))
        )

    def leave(self, group: str, worker_id: str, deadline: Deadline) -> Op[LeaseInfo]:
        req = pb.LeaveGroupRequest(group=group, worker_id=worker_id)
        return lease_info((yield from unary_call("LeaveGroup", req, deadline)))


class Cluster:
    """Each call to the parts of its group, on their shards."""

    def __init__(self, ops: ShardOps) -> None:
        self.ops = ops

    def create(
        self,
        req: pb.CreateGroupRequest,
        names: list[str],
        arrays: list[Array],
        state_arrays: list[Array],
        deadline: Deadline,
        table_arrays: Sequence[Sequence[Array]],
    ) -> Op[GroupInfo]:
        if req.tables:
            return _ids_cluster.create_group(
                self.ops, req, names, table_arrays, deadline
            )
        return _sharded.create_group(
            self.ops, req, names, arrays, state_arrays, deadline
        )

    def describe(self, name: str, deadline: Deadline) -> Op[GroupInfo]:
        return _sharded.describe_group(self.ops, name, deadline)

    def list_groups(self, prefix: str, deadline: Deadline) -> Op[list[GroupInfo]]:
        return _sharded.list_groups(self.ops, prefix, deadline)

    def delete(self, name: str, deadline: Deadline) -> Op[bool]:
        self.ops.pending.forget(name)  # its parts are deleted: nothing to finish
        return _sharded.delete_group(self.ops, name, deadline)

    def set_learning_rate(
        self, name: str, learning_rate: float, deadline: Deadline
    ) -> Op[GroupInfo]:
        return _sharded.set_learning_rate(self.ops, name, learning_rate, deadline)

    def push(
        self,
        req: pb.PushRequest,
        arrays: list[Array],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult]:
        # The parts' X is joined from their replies (push_detailed then copies it
        # into ``out``).
        return _sharded.push(self.ops, req, arrays, deadline)

    def pull(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding,
        out: Sequence[Array] | None,
        allow_apart: bool,
    ) -> Op[tuple[int, list[Array]]]:
        # The parts' X is joined (pull then copies it into ``out``).
        return _sharded.pull(
            self.ops, group, state, min_version, deadline, encoding, allow_apart
        )

    def rewind(self, group: str, to_step: int, deadline: Deadline) -> Op[RewindInfo]:
        return _sharded.rewind(self.ops, group, to_step, deadline)

    def fork(
        self, group: str, new_group: str, at_step: int, deadline: Deadline
    ) -> Op[RewindInfo]:
        if self.ops.shards == 1:  # a cluster found through etcd of one shard
            return OneServer(self.ops).fork(group, new_group, at_step, deadline)
        return _refused(
            InvalidArgumentError(
                f"fork of {group!r} on a cluster: not supported yet (a new "
                "group's parts are placed by its own name); rewind, export the "
                "group and import it under the new name instead"
            )
        )

    def history(self, group: str, deadline: Deadline) -> Op[HistoryInfo]:
        return _sharded.history(self.ops, group, deadline)

    def save(self, deadline: Deadline) -> Op[SaveInfo]:
        """Every shard writes a snapshot; their paths joined with ", " in shard
        order."""
        replies = yield from _sharded.save(self.ops, deadline)
        return SaveInfo(
            ", ".join(m.path for m in replies),
            sum(m.groups for m in replies),
            sum(m.bytes for m in replies),
        )

    def push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        base_version: int | None,
        learning_rate: float | None,
        deadline: Deadline,
        encoding: Encoding,
    ) -> Op[PushResult]:
        return _rowsplit.push_rows(
            self.ops, group, gradients, base_version, learning_rate, deadline, encoding
        )

    def pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        state: bool,
        min_version: int | None,
        deadline: Deadline,
    ) -> Op[dict[str, Array]]:
        return _rowsplit.pull_rows(
            self.ops, group, selections, state, min_version, deadline
        )

    def list_rows(
        self,
        group: str,
        table: str,
        page_token: str,
        page_size: int,
        values: bool,
        state: bool,
        deadline: Deadline,
    ) -> Op[RowsPage]:
        ops = self.ops
        found = yield from _sharded.layout(ops, group, deadline)
        if _ids_cluster.is_ids_layout(found):
            return (
                yield from _ids_cluster.list_rows(
                    ops, found, table, page_token, page_size, values, state, deadline
                )
            )
        if len(found.parts) != 1:
            raise InvalidArgumentError(
                f"group {group!r} has no ids tables: it is split into "
                f"{len(found.parts)} parts of fixed tensors, and list_rows lists the "
                "ids of an ids table",
                reason="UNKNOWN_TENSOR",
                metadata={"group": group},
            )
        (part,) = found.parts
        op = ops.list_rows(
            part.name, table, page_token, page_size, values, state, deadline
        )
        return (yield from on_shard(ops.shard_of(part.name, part.shard), op))

    def join(
        self, group: str, worker_id: str, deadline: Deadline
    ) -> Op[tuple[Targets, LeaseInfo]]:
        """Join every part of a group: its parts, and the lease as the first part
        answered it."""
        targets = yield from _sharded.part_targets(self.ops, group, deadline)
        reply = yield from _sharded.leases(
            self.ops, "JoinGroup", targets, worker_id, deadline
        )
        return targets, lease_info(reply)

    def leave(self, group: str, worker_id: str, deadline: Deadline) -> Op[LeaseInfo]:
        """Leave every part of a group; the lease as the first part answered."""
        targets = yield from _sharded.part_targets(self.ops, group, deadline)
        reply = yield from _sharded.leases(
            self.ops, "LeaveGroup", targets, worker_id, deadline
        )
        return lease_info(reply)


# Where a client's calls go: every operation that depends on where a group lives
# asks it (the same methods on both)
Route = OneServer | Cluster
