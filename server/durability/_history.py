"""A group's history: the steps it can go back to, and its state as of one of them.

The data directory keeps snapshots and the write-ahead log since the oldest one
kept; together they hold every step of every group since that snapshot. A step is
reached from the nearest *base* at or before it (a snapshot's copy of the group, or
a log record carrying the group's whole state: its create, or an earlier rewind)
by replaying the group's own records after that base, and no other group's.

Where each group's records are is kept in ``LogIndex``: per group, each record's
lsn, op, segment and byte offset, read from the records' headers only (bodies are
skipped with a seek), once: each use reads on from where the last one stopped. It
lives in memory (about 100 bytes a record, built on the first rewind, fork or
history call) and is read again from the log after a restart.

The *line* of a group is its history as it stands: a rewind cuts the steps after
its target off the line (they stay in the log, as history, until retention drops
them), and a delete ends it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnxps.wire.image import GroupImage

from ..errors import FailedPrecondition, InvalidArgument
from ..store import GroupCapture, GroupRuntime, ParameterStore
from ._redo import redo
from ._snapshot import SnapshotError, list_snapshots, load_group, read_manifest
from ._walread import (
    FRAME,
    MAGIC,
    MAX_HEADER,
    _arrays,
    _check_segment,
    _read_frame,
    crc32,
    segment_paths,
)

__all__ = [
    "Base",
    "GroupHistory",
    "LogIndex",
    "Point",
    "Reached",
    "build",
    "read_base",
    "renamed",
    "snapshot_points",
]

Array = np.ndarray[Any, Any]

_HEADERS_ONLY = 1 << 62  # ``_read_frame``'s skip_upto: every body skipped
# ops that change a group's state without carrying it whole
_REPLAYED = frozenset({"push", "push_rows", "sync_step", "set_lr"})


@dataclass(frozen=True, slots=True)
class Record:
    """Where one record of a group is in the log, and what it is."""

    lsn: int
    op: str
    path: str  # its segment
    offset: int  # its frame's first byte in the segment
    unix: float | None  # when it was logged (records of older releases: None)
    to_step: int | None = None  # a rewind's target, a create's T
    moved: bool = False  # a create that imported the group a resharding moved


class LogIndex:
    """Each group's records in the log (see the module's docstring); thread-safe."""

    def __init__(self, wal_dir: str) -> None:
        self.wal_dir = wal_dir
        self._lock = threading.Lock()
        self._records: dict[str, list[Record]] = {}
        self._read: dict[str, int] = {}  # segment path -> bytes indexed
        self._last = 0  # the last lsn indexed

    def refresh(self, upto: int) -> None:
        """Index the records after the last one indexed, up to lsn ``upto`` (the
        durable ones); drop those of segments no longer on disk."""
        with self._lock:
            segments = [path for _, path in segment_paths(self.wal_dir)]
            kept = set(segments)
            for path in [p for p in self._read if p not in kept]:
                del self._read[path]
                for name, recs in self._records.items():
                    self._records[name] = [r for r in recs if r.path != path]
            for path in segments:
                if not self._segment(path, upto):
                    break

    def _segment(self, path: str, upto: int) -> bool:
        """Index one segment; False when it stops before its end (``upto``, or a
        frame not whole yet)."""
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return True  # pruned meanwhile
        with f:
            start = self._read.get(path, 0)
            if start == 0:
                if not _check_segment(f, path):
                    return False
            else:
                f.seek(start)
            while True:
                pos = f.tell()
                try:
                    frame = _read_frame(f, skip_upto=_HEADERS_ONLY)
                except ValueError:
                    frame = None  # being written, or torn: read again next time
                    self._read[path] = pos
                    return False
                if frame is None:
                    self._read[path] = pos
                    return True
                header, _ = frame
                if header.get("op") == "void":
                    continue
                lsn = int(header.get("lsn", 0))
                if lsn > upto:
                    self._read[path] = pos
                    return False
                if lsn > self._last:
                    self._add(header, path, pos)
                    self._last = lsn

    def _add(self, h: dict[str, Any], path: str, pos: int) -> None:
        op = str(h.get("op"))
        to_step = None
        if op == "rewind":
            to_step = int(h["to_step"])
        elif op == "create":
            to_step = int(h["image"]["update_count"])
        unix = h.get("unix")
        moved = op == "create" and "moved" in h
        record = Record(int(h["lsn"]), op, path, pos, unix, to_step, moved)
        self._records.setdefault(str(h.get("group", "")), []).append(record)

    def records(self, group: str) -> list[Record]:
        with self._lock:
            return list(self._records.get(group, ()))

    def log_bytes(self) -> int:
        """The size of the log's segments on disk."""
        total = 0
        for _, path in segment_paths(self.wal_dir):
            try:
                total += os.path.getsize(path)
            except FileNotFoundError:
                pass
        return total


@dataclass(frozen=True)
class Base:
    """A whole copy of the group: a snapshot's (``index`` in its manifest) or a
    log record's (a create or a rewind)."""

    kind: str  # "snapshot", "create" or "rewind"
    key: float  # its place in the log: after record floor(key)
    path: str  # the snapshot directory, or the record's segment
    index: int = 0  # the group's entry in the snapshot manifest
    offset: int = 0  # the record's frame in its segment


@dataclass(frozen=True)
class Point:
    """A step on the group's line: T after a record (or in a base), and when."""

    step: int
    key: float  # its place in the log (``Base.key``)
    unix: float | None
    kind: str  # "snapshot", "create", "moved" (a create by a move), "rewind", "step"
    base: Base | None = None


@dataclass(frozen=True)
class Reached:
    """A group's state as of a step: the capture, and how it was computed."""

    capture: GroupCapture
    base: Base
    base_step: int
    replayed: int  # records replayed after the base
    read_seconds: float = 0.0  # the base read (and checked)
    replay_seconds: float = 0.0  # the records read and replayed


@dataclass
class GroupHistory:
    """One group's line, from its bases and its records in the log."""

    name: str
    sync: bool
    points: list[Point] = field(default_factory=list)
    replayed: list[Record] = field(default_factory=list)  # every state change

    @property
    def oldest(self) -> int | None:
        return self.points[0].step if self.points else None

    @property
    def newest(self) -> int | None:
        return self.points[-1].step if self.points else None

    def steps(self) -> list[Point]:
        """The reachable steps, one point each (the last of each T), oldest first."""
        last: dict[int, Point] = {}
        for p in self.points:
            last[p.step] = p
        return sorted(last.values(), key=lambda p: p.step)

    def check_reachable(self, step: int) -> Point:
        """The point of ``step`` on the line; the refusal says what can be reached."""
        meta = {"group": self.name, "to_step": step}
        if not self.points:
            raise FailedPrecondition(
                f"group {self.name!r} has no step it can go back to: neither a "
                "snapshot nor its create is kept; take a snapshot (Save) first",
                reason="STEP_NOT_RETAINED",
                metadata=meta,
            )
        oldest, newest = self.points[0].step, self.points[-1].step
        meta |= {"oldest_step": oldest, "newest_step": newest}
        if step > newest:
            raise InvalidArgument(
                f"group {self.name!r} is at T={newest}; it cannot go to T={step}, a "
                f"step it has not taken; pick a step from {oldest} to {newest}",
                reason="STEP_AHEAD",
                field="to_step",
                metadata=meta,
            )
        found = [p for p in self.points if p.step == step]
        first = self.points[0]
        if not found and step < oldest and first.kind == "moved":
            when = _utc(first.unix)
            raise FailedPrecondition(
                f"step T={step} of group {self.name!r} is from before a resharding "
                f"moved the group to this shard (at T={first.step}, {when}): a "
                "shard keeps a moved group's history from its move on, so the "
                f"oldest step it can go back to is T={oldest} (the newest, "
                f"T={newest}); the shard it moved from deleted its copy. To keep "
                "a step across a resharding, export the group (onnxps export to "
                "a .npz file keeps its optimizer state) before resharding",
                reason="STEP_NOT_RETAINED",
                metadata=meta
                | {"moved_step": first.step, "moved_unix": first.unix or 0.0},
            )
        if not found:
            raise FailedPrecondition(
                f"step T={step} of group {self.name!r} is no longer kept: the "
                f"oldest step it can go back to is T={oldest} (the newest, "
                f"T={newest}); retention (--keep-snapshots, --keep-seconds, "
                "--keep-bytes) dropped the older ones",
                reason="STEP_NOT_RETAINED",
                metadata=meta,
            )
        return found[-1]

    def reach(
        self, step: int, wal_dir: str, read_base: Callable[[Base], GroupCapture]
    ) -> Reached:
        """The group's state right after step ``step``: its nearest base at or
        before it, and the group's records after that base replayed."""
        target = self.check_reachable(step)
        bases = [p for p in self.points if p.base is not None and p.key <= target.key]
        point = bases[-1]
        assert point.base is not None
        base = point.base
        started = time.perf_counter()
        captured = read_base(base)
        read = time.perf_counter() - started
        image = captured.image
        if image.name != self.name:
            image = renamed(image, self.name)
        scratch = ParameterStore()
        runtime = captured.runtime if base.kind == "snapshot" else None
        scratch.install(image, runtime)
        records = [r for r in self.replayed if base.key < r.lsn <= target.key]
        with RecordReader() as reader:
            for r in records:
                header, arrays = reader.read(r)
                redo(scratch, header, arrays, wal_dir)
        state = scratch.release(self.name)  # its arrays, not a copy
        scratch.close()
        replayed = time.perf_counter() - started - read
        capture = GroupCapture(state, GroupRuntime())
        return Reached(capture, base, point.step, len(records), read, replayed)


def _utc(unix: float | None) -> str:
    """``unix`` as an ISO 8601 UTC time, for messages."""
    if not unix:
        return "at a time not logged"
    t = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return "on " + t.isoformat(timespec="seconds").replace("+00:00", "Z")


def renamed(image: GroupImage, name: str) -> GroupImage:
    """The image under another group name."""
    return GroupImage(dataclasses.replace(image.definition, name=name), image.arrays)


class RecordReader:
    """Reads records by their place (``Record``), each segment opened once, every
    body into one buffer it reuses: a record's arrays are views of it, valid until
    the next read (a replayed push steps with them, or copies them)."""

    def __init__(self) -> None:
        self._files: dict[str, Any] = {}
        self._buf = bytearray()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def read(self, r: Record) -> tuple[dict[str, Any], list[Array]]:
        text, body = self.read_raw(r)
        header = json.loads(text)
        return header, _arrays(header, body)  # type: ignore[arg-type]

    def read_raw(self, r: Record) -> tuple[bytes, memoryview]:
        """The record's JSON header and its body (valid until the next read)."""
        f = self._files.get(r.path)
        if f is None:
            f = self._files[r.path] = open(r.path, "rb", buffering=0)  # noqa: SIM115
        f.seek(r.offset)
        prefix = f.read(FRAME.size)
        if len(prefix) < FRAME.size:
            raise ValueError(f"{r.path}: no record at byte {r.offset}")
        magic, hlen, blen, crc = FRAME.unpack(prefix)
        if magic != MAGIC or hlen > MAX_HEADER:
            raise ValueError(f"{r.path}: bad frame at byte {r.offset}")
        text = f.read(hlen)
        if len(self._buf) < blen:
            self._buf = bytearray(blen)
        body = memoryview(self._buf)[:blen]
        got = 0
        while got < blen:
            n = f.readinto(body[got:])
            if not n:
                raise ValueError(f"{r.path}: record at byte {r.offset} cut short")
            got += n
        if len(text) < hlen or crc32(body, crc32(text, 0)) != crc:
            raise ValueError(f"{r.path}: record at byte {r.offset} is damaged")
        return text, body


def read_record(r: Record) -> tuple[dict[str, Any], list[Array]]:
    """The header and arrays of the record at ``r``."""
    with open(r.path, "rb") as f:
        f.seek(r.offset)
        frame = _read_frame(f)
    if frame is None:
        raise ValueError(f"{r.path}: no record at byte {r.offset}")
    header, (_, _, body) = frame
    return header, _arrays(header, body)


@dataclass(frozen=True)
class SnapshotPoint:
    """A snapshot's copy of one group."""

    directory: str
    index: int
    covered: int  # the group's records up to this lsn are in it
    step: int
    unix: float


def snapshot_points(snap_dir: str, group: str) -> list[SnapshotPoint]:
    """The kept snapshots' copies of ``group``, oldest first (damaged ones left
    out: a restore would not use them either)."""
    out = []
    for _, path in reversed(list_snapshots(snap_dir)):
        try:
            manifest = read_manifest(path)
        except SnapshotError:
            continue
        unix = _created(manifest.path)
        for k, entry in enumerate(manifest.groups):
            try:
                d = entry["image"]
                if d["name"] != group:
                    continue
                covered = int(entry["covered_lsn"])
                step = int(d["update_count"])
            except (KeyError, TypeError, ValueError):
                continue
            out.append(SnapshotPoint(path, k, covered, step, unix))
    return out


def _created(manifest_path: str) -> float:
    try:
        with open(manifest_path, encoding="utf-8") as f:
            return float(json.load(f).get("created_unix", 0.0))
    except (OSError, ValueError, TypeError):
        return 0.0


def build(
    name: str, sync: bool, records: list[Record], snaps: list[SnapshotPoint]
) -> GroupHistory:
    """The group's line from its records and its snapshots' copies, in log order."""
    h = GroupHistory(name, sync)
    events: list[tuple[float, Any]] = [(r.lsn, r) for r in records]
    events += [(s.covered + 0.5, s) for s in snaps]
    events.sort(key=lambda e: e[0])
    line: list[Point] = []
    for key, ev in events:
        if isinstance(ev, SnapshotPoint):
            base = Base("snapshot", key, ev.directory, index=ev.index)
            point = Point(ev.step, key, ev.unix, "snapshot", base)
            if line and line[-1].step != ev.step:
                line = []  # records before it are missing: start from it
            line.append(point)
            continue
        r: Record = ev
        if r.op == "create":
            base = Base("create", key, r.path, offset=r.offset)
            kind = "moved" if r.moved else "create"
            line = [Point(r.to_step or 0, key, r.unix, kind, base)]
        elif r.op == "delete":
            line = []
        elif r.op == "rewind":
            assert r.to_step is not None
            base = Base("rewind", key, r.path, offset=r.offset)
            line = [p for p in line if p.step <= r.to_step]
            line.append(Point(r.to_step, key, r.unix, "rewind", base))
        elif r.op in _REPLAYED:
            if not line:
                continue  # before any base kept: not reachable
            h.replayed.append(r)
            steps = r.op == "sync_step" or (not sync and r.op != "set_lr")
            if steps:
                line.append(Point(line[-1].step + 1, key, r.unix, "step"))
    h.points = line
    return h


def read_base(base: Base) -> GroupCapture:
    """The group's copy in ``base``."""
    if base.kind == "snapshot":
        return load_group(base.path, base.index)
    header, arrays = read_record(
        Record(int(base.key), base.kind, base.path, base.offset, None)
    )
    image = GroupImage.from_json(header["image"], arrays, base.path)
    return GroupCapture(image, GroupRuntime())
