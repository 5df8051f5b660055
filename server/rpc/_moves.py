"""Resharding's RPCs (docs/resharding.md): one group's move between shards, sent by
``onnxps reshard`` to the source's and the target's primaries.

``ExportGroup`` fences the group on its source (its calls are answered MOVED from
then on, the changes in flight finish) and streams it as a one-group snapshot, the
format a standby catching up receives (docs/FORMAT.md, "Snapshot"): the image,
its exactly-once windows and sync rounds. ``ImportGroup`` installs it on the
target, held (its calls wait) until ``MoveGroup`` ACTIVATE, after a snapshot of the
target made it durable there. ``MoveGroup`` RELEASE deletes the source's copy
(a logged delete) once the placement map names the target.

A source with a write-ahead log is followed instead of copied under the fence:
``ExportGroup`` ``follow`` sends the snapshot unfenced with the lsn it holds, then
``records`` sends the group's log records after an lsn (read by the log's
per-group index, ``durability._history``), which ``ImportGroup`` logs on the
target and applies through the replay path; only the last records are sent
fenced.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from onnxps.v1 import parameter_server_pb2 as pb

from ..durability import Durability
from ..durability._history import RecordReader
from ..durability._redo import redo
from ..durability._snapshot import load_snapshot, write_snapshot
from ..durability._walread import _arrays
from ..errors import FailedPrecondition, InvalidArgument, NotFound
from ._common import RpcFamily, streaming, unary

__all__ = ["MoveRpcs"]

log = logging.getLogger("onnxps.service")

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

    def _log_of(self, group: str) -> Durability:
        """The source's write-ahead log, which a move that follows it reads."""
        d = self._durability
        if d is None or d.journal is None:
            mode = "none" if d is None else d.mode
            raise FailedPrecondition(
                f"group {group!r} cannot be followed on this server: it keeps no "
                f"write-ahead log (--durability {mode}); a move copies it under "
                "the fence instead",
                reason="NO_HISTORY",
                metadata={"group": group},
            )
        return d

    @streaming
    def ExportGroup(
        self, request: pb.ExportGroupRequest, context: Any
    ) -> Iterator[pb.ExportGroupResponse]:
        if request.records:
            yield from self._export_records(request)
            return
        current_lsn: Callable[[], int] = lambda: 0  # noqa: E731
        if request.follow:
            journal = self._log_of(request.group).journal
            assert journal is not None
            current_lsn = journal.last_lsn
        captured = self.store.export_group(
            request.group, request.to_shard, request.fence, current_lsn
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
            lsn = captured.runtime.covered_lsn
            done = pb.ReplicaSnapshotDone(wal_lsn=lsn, generation=1)
            yield pb.ExportGroupResponse(done=done)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _export_records(
        self, request: pb.ExportGroupRequest
    ) -> Iterator[pb.ExportGroupResponse]:
        """The group's log records after ``after_lsn`` (fenced first, with
        ``fence``: then they are its last)."""
        name, after = request.group, int(request.after_lsn)
        durability = self._log_of(name)
        if request.fence:
            self.store.fence_group(name, request.to_shard)
        elif not self.store.holds(name):
            raise NotFound(
                f"no group named {name!r} on this shard to move",
                metadata={"group": name},
            )
        last, sent, count = after, 0, 0
        with RecordReader() as reader:
            for r in durability.records_after(name, after):
                text, body = reader.read_raw(r)
                size = len(body)
                offset = 0
                while True:
                    data = bytes(body[offset : offset + _PIECE])
                    piece = pb.GroupRecordPiece(
                        lsn=r.lsn,
                        header=text if offset == 0 else b"",
                        data=data,
                        offset=offset,
                        size=size,
                    )
                    yield pb.ExportGroupResponse(record=piece)
                    offset += len(data)
                    if offset >= size:
                        break
                last, sent, count = r.lsn, sent + size + len(text), count + 1
        log.info(
            "sent %d log records of group %s after record %d (%d bytes)%s",
            count,
            name,
            after,
            sent,
            ", fenced" if request.fence else "",
        )
        yield pb.ExportGroupResponse(done=pb.ReplicaSnapshotDone(wal_lsn=last))

    @unary
    def ImportGroup(
        self, request_iterator: Iterable[pb.ImportGroupRequest], context: Any
    ) -> pb.ImportGroupResponse:
        root = tempfile.mkdtemp(prefix="onnxps-import-")
        try:
            received, complete = 0, False
            for msg in request_iterator:
                # records (a done of generation 0 ends a records stream)
                if msg.HasField("record") or (
                    msg.HasField("done") and not received and not msg.done.generation
                ):
                    return self._import_records(msg, request_iterator)
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

    def _import_records(
        self, first: pb.ImportGroupRequest, rest: Iterable[pb.ImportGroupRequest]
    ) -> pb.ImportGroupResponse:
        """Log and apply, as a replay does, the records of a group imported here
        (held) that its source logged after its snapshot."""
        received, count, name = 0, 0, ""
        header: bytes = b""
        body = bytearray()
        msg: pb.ImportGroupRequest | None = first
        it = iter(rest)
        complete = False
        while msg is not None:
            if msg.HasField("done"):
                complete = True
                break
            if not msg.HasField("record"):
                raise InvalidArgument(
                    "ImportGroup: a snapshot's piece among log records"
                )
            piece = msg.record
            if piece.offset == 0:
                header, body = piece.header, bytearray(piece.size)
            if piece.offset + len(piece.data) > len(body) or not header:
                raise InvalidArgument(
                    f"ImportGroup: record {piece.lsn}'s piece at {piece.offset} "
                    "does not fit its body"
                )
            body[piece.offset : piece.offset + len(piece.data)] = piece.data
            received += len(piece.data)
            if piece.offset + len(piece.data) == piece.size:
                name = self._apply_record(piece.lsn, header, body)
                received += len(header)
                count += 1
            msg = next(it, None)
        if not complete:
            raise InvalidArgument(
                "ImportGroup ended before its records did (no done message)"
            )
        unlogged = self._durability is None or self._durability.journal is None
        if count and unlogged and self._save is not None:
            self._save()  # durable here before the map names this shard
        t = self.store.update_count_of(name) if name else 0
        return pb.ImportGroupResponse(
            group=name, update_count=t, bytes=received, records=count
        )

    def _apply_record(self, lsn: int, text: bytes, body: bytearray) -> str:
        try:
            h = json.loads(text)
            arrays = _arrays(h, body)  # type: ignore[arg-type]
            name = str(h["group"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(
                f"ImportGroup: record {lsn} is unreadable: {exc}"
            ) from None
        # logged here without the source's numbering (this log numbers it)
        for key in ("lsn", "unix", "term"):
            h.pop(key, None)
        with self.store.moves.applying(name):
            redo(self.store, h, arrays, "ImportGroup", logged=True)
        return name
