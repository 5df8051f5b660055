"""The RPCs about a group's past: Rewind, Fork and History (``durability``'s
``_history`` computes the state; these decode, call it and encode)."""

from __future__ import annotations

from typing import Any

from onnxps.v1 import parameter_server_pb2 as pb

from ..durability import Durability, Rewound
from ..errors import FailedPrecondition, InvalidArgument
from ._common import RpcFamily, unary
from ._convert import group_info

__all__ = ["HISTORY_PAGE_STEPS", "HistoryRpcs"]

# The most steps one History reply lists (about 22 bytes each: 1.5 MiB, under
# gRPC's default 4 MiB message limit of a client in any language); a longer
# history is paged (``more``, ``start_step``).
HISTORY_PAGE_STEPS = 65536


class HistoryRpcs(RpcFamily):
    """Rewind, Fork, History."""

    def _history_of(self) -> Durability:
        if self._durability is None:
            # Not UNAVAILABLE: the client retries that, and no retry will help.
            raise FailedPrecondition(
                "this server keeps no data directory (started with --durability "
                "none), so no group has a history: start it with --data-dir and "
                "--durability wal to rewind and fork groups",
                reason="NO_HISTORY",
            )
        return self._durability

    @unary
    def Rewind(self, request: pb.RewindRequest, context: Any) -> pb.RewindResponse:
        done = self._history_of().rewind(request.group, int(request.to_step))
        view = self.store.describe(request.group)
        return pb.RewindResponse(
            group=group_info(view), from_step=done.from_step, reached=_reached(done)
        )

    @unary
    def Fork(self, request: pb.ForkRequest, context: Any) -> pb.ForkResponse:
        if not request.new_group:
            raise InvalidArgument(
                "a fork needs new_group, the name of the group it creates",
                field="new_group",
            )
        done = self._history_of().fork(
            request.group, request.new_group, int(request.at_step)
        )
        view = self.store.describe(request.new_group)
        return pb.ForkResponse(
            group=group_info(view), reached=_reached(done), from_step=done.from_step
        )

    @unary
    def History(self, request: pb.HistoryRequest, context: Any) -> pb.HistoryResponse:
        durability = self._history_of()
        history = durability.history(request.group)
        snap_bytes, wal_bytes = durability.retained_bytes()
        limit = min(int(request.limit) or HISTORY_PAGE_STEPS, HISTORY_PAGE_STEPS)
        start = int(request.start_step)
        steps = [p for p in history.steps() if p.step >= start]
        return pb.HistoryResponse(
            group=request.group,
            steps=[
                pb.HistoryStep(step=p.step, unix_time=p.unix or 0.0, kind=p.kind)
                for p in steps[:limit]
            ],
            update_count=self.store.describe(request.group).update_count,
            snapshot_bytes=snap_bytes,
            wal_bytes=wal_bytes,
            more=len(steps) > limit,
        )


def _reached(done: Rewound) -> pb.ReachedFrom:
    r = done.reached
    return pb.ReachedFrom(
        base=r.base.kind,
        base_step=r.base_step,
        replayed=r.replayed,
        seconds=done.seconds,
    )
