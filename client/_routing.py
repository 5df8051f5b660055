"""``RoutingCore``: the operations of ``ClientCore``, routed on a cluster.

Both clients derive from it. Given one address, every operation is
``ClientCore``'s; given a list of shard addresses (``shards`` set), each one goes
to the parts of its group (``_sharded``, ``_rowsplit``, ``_ids_cluster``), as
operations that either client runs: the routing is written once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.encoding import Encoding

from . import _ids_cluster, _rowsplit, _sharded
from ._cluster import Layout
from ._errors import InvalidArgumentError, RpcError
from ._ops import Deadline, Op, on_shard
from ._pending import PendingPushes
from ._records import GroupInfo, LeaseInfo, PushResult, RowsPage, SaveInfo, lease_info
from ._requests import ClientCore, log

__all__ = ["RoutingCore", "Targets"]

Array = np.ndarray[Any, Any]
# (shard, name on it) of each part of a group
Targets = list[tuple[int, str]]


class RoutingCore(ClientCore):
    """ClientCore whose operations a cluster client routes to its shards."""

    def _setup(self) -> None:
        self._layouts: dict[str, Layout] = {}
        # per group, the pushes whose parts did not all land (sent first by the
        # group's next push or pull)
        self._pending = PendingPushes()

    def _drop_pending(self) -> None:
        """The client closes: the pushes whose parts did not all land stay apart on
        the parts that missed them (docs/cluster.md, "When the parts of a split
        group disagree"); said once per push."""
        for entry in self._pending.every():
            log.warning(
                "closing the client with push seq %d to %s not landed on %s (%s): "
                "the other parts took it (or may have), and stay a push ahead",
                entry.seq,
                entry.group,
                ", ".join(str(p[1].group) for p in entry.parts),
                entry.why,
            )
            self._pending.replace(entry, None)

    # -- groups --------------------------------------------------------------------
    def _create_parts(
        self,
        req: pb.CreateGroupRequest,
        names: list[str],
        arrays: list[Array],
        state_arrays: list[Array],
        deadline: Deadline,
        *,
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> Op[GroupInfo]:
        if self.shards is None:
            return super()._create_parts(
                req, names, arrays, state_arrays, deadline, table_arrays=table_arrays
            )
        if req.tables:
            return _ids_cluster.create_group(self, req, names, table_arrays, deadline)
        return _sharded.create_group(self, req, names, arrays, state_arrays, deadline)

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        if self.shards is None:
            return super()._describe_group(name, timeout=timeout)
        return _sharded.describe_group(self, name, self._deadline(timeout))

    def _list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> Op[list[GroupInfo]]:
        if self.shards is None:
            return super()._list_groups(prefix, timeout=timeout)
        return _sharded.list_groups(self, prefix, self._deadline(timeout))

    def _delete_group(self, name: str, *, timeout: float | None = None) -> Op[bool]:
        if self.shards is None:
            return super()._delete_group(name, timeout=timeout)
        self._sizes.pop(name, None)
        self._pending.forget(name)  # its parts are deleted: nothing to finish
        return _sharded.delete_group(self, name, self._deadline(timeout))

    def _set_learning_rate(
        self, name: str, learning_rate: float, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        if self.shards is None:
            return super()._set_learning_rate(name, learning_rate, timeout=timeout)
        deadline = self._deadline(timeout)
        return _sharded.set_learning_rate(self, name, learning_rate, deadline)

    # -- push and pull -------------------------------------------------------------
    def _push_parts(
        self,
        req: pb.PushRequest,
        arrays: list[Array],
        deadline: Deadline,
        out: Sequence[Array] | None = None,
    ) -> Op[PushResult]:
        if self.shards is None:
            return super()._push_parts(req, arrays, deadline, out)
        # The parts' X is joined from their replies (push_detailed then copies it
        # into ``out``).
        return _sharded.push(self, req, arrays, deadline)

    def _pull_parts(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding = "native",
        out: Sequence[Array] | None = None,
        allow_apart: bool = False,
    ) -> Op[tuple[int, list[Array]]]:
        if self.shards is None:
            return super()._pull_parts(
                group, state, min_version, deadline, encoding, out
            )
        # The parts' X is joined (pull then copies it into ``out``).
        return _sharded.pull(
            self, group, state, min_version, deadline, encoding, allow_apart
        )

    def _save(self, *, timeout: float | None = None) -> Op[SaveInfo]:
        """Ask the server (every shard of a cluster) to write a snapshot now; a
        cluster's paths are joined with ", " in shard order."""
        if self.shards is None:
            return (yield from super()._save(timeout=timeout))
        replies = yield from _sharded.save(self, self._deadline(timeout))
        return SaveInfo(
            ", ".join(m.path for m in replies),
            sum(m.groups for m in replies),
            sum(m.bytes for m in replies),
        )

    # -- rows ----------------------------------------------------------------------
    def _push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        *,
        base_version: int | None = None,
        learning_rate: float | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
    ) -> Op[PushResult]:
        if self.shards is None:
            return super()._push_rows(
                group,
                gradients,
                base_version=base_version,
                learning_rate=learning_rate,
                encoding=encoding,
                timeout=timeout,
            )
        deadline = self._deadline(timeout)
        enc = self._encoding(encoding, self.gradient_encoding, "encoding")
        return _rowsplit.push_rows(
            self, group, gradients, base_version, learning_rate, deadline, enc
        )

    def _pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> Op[dict[str, Array]]:
        if self.shards is None:
            return super()._pull_rows(
                group, selections, state=state, min_version=min_version, timeout=timeout
            )
        deadline = self._deadline(timeout)
        return _rowsplit.pull_rows(
            self, group, selections, state, min_version, deadline
        )

    def _list_rows(
        self,
        group: str,
        table: str,
        *,
        page_token: str = "",
        page_size: int = 0,
        values: bool = False,
        state: bool = False,
        timeout: float | None = None,
    ) -> Op[RowsPage]:
        if self.shards is None:
            return (
                yield from super()._list_rows(
                    group,
                    table,
                    page_token=page_token,
                    page_size=page_size,
                    values=values,
                    state=state,
                    timeout=timeout,
                )
            )
        deadline = self._deadline(timeout)
        found = yield from _sharded.layout(self, group, deadline)
        if _ids_cluster.is_ids_layout(found):
            return (
                yield from _ids_cluster.list_rows(
                    self, found, table, page_token, page_size, values, state, deadline
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
        op = self._list_rows_op(
            part.name, table, page_token, page_size, values, state, deadline
        )
        return (yield from on_shard(part.shard, op))

    # -- workers -------------------------------------------------------------------
    def _join_parts(
        self, group: str, worker_id: str, timeout: float | None
    ) -> Op[tuple[Targets, LeaseInfo]]:
        """Join every part of a group: its parts, and the lease as the first part
        answered it."""
        if self.shards is None:
            return [(0, group)], (yield from self._join_op(group, worker_id, timeout))
        deadline = self._deadline(timeout)
        targets = yield from _sharded.part_targets(self, group, deadline)
        reply = yield from _sharded.leases(
            self, "JoinGroup", targets, worker_id, deadline
        )
        return targets, lease_info(reply)

    def _leave_parts(
        self, group: str, worker_id: str, timeout: float | None
    ) -> Op[LeaseInfo]:
        """Leave every part of a group; the lease as the first part answered."""
        if self.shards is None:
            return (yield from self._leave_op(group, worker_id, timeout))
        deadline = self._deadline(timeout)
        targets = yield from _sharded.part_targets(self, group, deadline)
        reply = yield from _sharded.leases(
            self, "LeaveGroup", targets, worker_id, deadline
        )
        return lease_info(reply)

    def _heartbeats_op(
        self, targets: Targets, worker_id: str, interval: float
    ) -> Op[None]:
        """One heartbeat to each part, in turn; a failed one is logged (the next
        beat tries again). Raises ClientClosedError once the client is closed."""
        for shard, name in targets:
            beat = self._heartbeat_op(name, worker_id, interval)
            try:
                yield from on_shard(shard, beat)
            except RpcError as exc:
                log.warning("heartbeat for %s in %s failed: %s", worker_id, name, exc)
