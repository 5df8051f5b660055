"""Resharding's RPCs (docs/resharding.md): one group's move between shards, sent by
``onnxps reshard`` to the source's and the target's primaries.

``ExportGroup`` fences the group on its source (its calls are answered MOVED from
then on, the changes in flight finish) and streams it as a one-group snapshot, the
format a standby catching up receives (docs/FORMAT.md, "Snapshot"): the image,
its exactly-once windows and sync rounds. ``ImportGroup`` installs it on the
target, held (its calls wait) until ``MoveGroup`` ACTIVATE, after a snapshot of the
target made it durable there. ``MoveGroup`` RELEASE deletes the source's copy
(a logged delete) once the placement map names the target.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

from onnxps.v1 import parameter_server_pb2 as pb

from ..durability._snapshot import load_snapshot, write_snapshot
from ..errors import FailedPrecondition, InvalidArgument
from ._common import RpcFamily, streaming, unary

__all__ = ["MoveRpcs"]

_PIECE = 1 << 20


class MoveRpcs(RpcFamily):
    """MoveGroup, ExportGroup and ImportGroup."""

    @unary
    def MoveGroup(
        self, request: pb.MoveGroupRequest, context: Any
    ) -> pb.MoveGroupResponse:
        store, name, step = self.store, request.group, request.step
        if step == pb.MOVE_STEP_BEGIN_IMPORT:
            store.begin_import(name)
        elif step == pb.MOVE_STEP_ACTIVATE:
            if not store.holds(name):
                raise FailedPrecondition(
                    f"group {name!r} was not imported here: import it before ACTIVATE",
                    metadata={"group": name},
                )
            store.moves.activate(name, request.map_version)
        elif step == pb.MOVE_STEP_RELEASE:
            store.release_moved(name, request.to_shard, request.map_version)
        elif step == pb.MOVE_STEP_UNFENCE:
            store.moves.unfence(name)
        elif step == pb.MOVE_STEP_ABORT_IMPORT:
            store.moves.abort_import(name)
            if store.holds(name):
                store.delete_group(name)
        else:
            raise InvalidArgument(
                f"MoveGroup needs a step (BEGIN_IMPORT, ACTIVATE, RELEASE, UNFENCE, "
                f"ABORT_IMPORT), got {step}",
                metadata={"group": name},
            )
        present = store.holds(name)
        t = store.update_count_of(name) if present else 0
        return pb.MoveGroupResponse(present=present, update_count=t)

    @streaming
    def ExportGroup(
        self, request: pb.ExportGroupRequest, context: Any
    ) -> Iterator[pb.ExportGroupResponse]:
        captured = self.store.export_group(
            request.group, request.to_shard, request.fence
        )
        root = tempfile.mkdtemp(prefix="onnxps-export-")
        try:
            written = write_snapshot(root, 1, [captured], 0)
            for name in sorted(os.listdir(written.path)):
                with open(os.path.join(written.path, name), "rb") as f:
                    offset = 0
                    while True:
                        data = f.read(_PIECE)
                        chunk = pb.ReplicaSnapshotChunk(
                            name=name, offset=offset, data=data
                        )
                        yield pb.ExportGroupResponse(chunk=chunk)
                        offset += len(data)
                        if len(data) < _PIECE:
                            break
            done = pb.ReplicaSnapshotDone(wal_lsn=0, generation=1)
            yield pb.ExportGroupResponse(done=done)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    @unary
    def ImportGroup(
        self, request_iterator: Iterable[pb.ImportGroupRequest], context: Any
    ) -> pb.ImportGroupResponse:
        root = tempfile.mkdtemp(prefix="onnxps-import-")
        try:
            received, complete = 0, False
            for msg in request_iterator:
                if msg.HasField("done"):
                    complete = True
                    break
                piece = msg.chunk
                name = os.path.basename(piece.name)
                if not name or name != piece.name:
                    raise InvalidArgument(f"ImportGroup: bad file name {piece.name!r}")
                mode = "r+b" if piece.offset else "wb"
                with open(os.path.join(root, name), mode) as f:
                    f.seek(piece.offset)
                    f.write(piece.data)
                received += len(piece.data)
            if not complete:
                raise InvalidArgument(
                    "ImportGroup ended before its snapshot did (no done message)"
                )
            _, captures = load_snapshot(root)
            if len(captures) != 1:
                raise InvalidArgument(
                    f"ImportGroup takes one group, the snapshot holds {len(captures)}"
                )
            view, logged = self.store.import_group(captures[0])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if not logged and self._save is not None:
            self._save()  # durable here before the map names this shard
        return pb.ImportGroupResponse(
            group=view.name, update_count=view.update_count, bytes=received
        )
