"""The write-ahead log on disk: its format (docs/FORMAT.md) and its one reader.

A segment starts with ``b"ONNXPSWL" | u32 format version`` and then holds one
frame per record::

    magic b"OPSW" | u32 header length | u64 body length | u32 crc32 | header | body

``LogReader`` reads the log back, two ways over the same frames. Iterated, it
yields every intact record after an lsn, decoded, for the replay at start: it
tells a torn tail (the last frame of the last segment cut short by a crash: normal,
dropped with a warning) from corruption (a bad frame with intact records after it,
or in a segment that is not the last), which raises ``WalCorruptError`` naming the
segment and byte offset, unless the operator asked to truncate the log there.
``frames`` yields the records of an lsn range as the log holds them, for a
replicated shard's primary to ship: every one of them, or ``WalGapError`` when one
cannot be read (pruned, torn, damaged), so that a record is never skipped.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "FRAME",
    "MAGIC",
    "MAX_HEADER",
    "SEGMENT_HEADER",
    "SEGMENT_MAGIC",
    "WAL_FORMAT_VERSION",
    "LogCursor",
    "LogReader",
    "WalCorruptError",
    "WalFormatError",
    "WalGapError",
    "crc32",
    "fsync_dir",
    "logged_term",
    "read_segments",
    "segment_name",
    "segment_paths",
]

log = logging.getLogger("onnxps.durability")

Array = np.ndarray[Any, Any]

MAGIC = b"OPSW"
FRAME = struct.Struct("<4sIQI")
SEGMENT_MAGIC = b"ONNXPSWL"
SEGMENT_HEADER = struct.Struct("<8sI")
WAL_FORMAT_VERSION = 2
MAX_HEADER = 1 << 20

# A frame's checksum is zlib's CRC-32. zlib-ng's (the ``fast`` and ``replication``
# extras) gives the same value about 9 times faster, with the CPU's carry-less
# multiply: 3 against 30 ms for a 64 MiB record, which the log, a replicated
# shard's primary and each standby all compute.
crc32: Callable[[Any, int], int]
try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - without the extras
    crc32 = zlib.crc32


class WalFormatError(Exception):
    """A log segment this server cannot read; the message names the file."""


class WalCorruptError(WalFormatError):
    """Damage in the middle of the log; the message names the segment and offset."""


class WalGapError(Exception):
    """A record asked of the log (``LogReader.frames``) is not there to read."""


def segment_name(first_lsn: int) -> str:
    return f"wal-{first_lsn:020d}.log"


def segment_paths(wal_dir: str) -> list[tuple[int, str]]:
    """(lsn of the first record, path) of every segment, oldest first."""
    out = []
    for entry in os.listdir(wal_dir):
        if entry.startswith("wal-") and entry.endswith(".log"):
            try:
                out.append((int(entry[4:-4]), os.path.join(wal_dir, entry)))
            except ValueError:
                continue
    return sorted(out)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_frame(
    f: Any, skip_upto: int | None = None
) -> tuple[dict[str, Any], list[bytes]] | None:
    """One frame: its header and its bytes as the log holds them (the prefix, the
    header, the body), or None at a clean end; ValueError for a torn or bad frame.
    With ``skip_upto``, a record of lsn <= skip_upto comes with no bytes: its body
    is neither read nor checked."""
    raw = f.read(FRAME.size)
    if not raw:
        return None
    if len(raw) < FRAME.size:
        raise ValueError("truncated frame header")
    magic, hlen, blen, crc = FRAME.unpack(raw)
    if magic != MAGIC or hlen > MAX_HEADER:
        raise ValueError("bad frame magic or header length")
    text = f.read(hlen)
    if len(text) < hlen:
        raise ValueError("truncated record")
    if skip_upto is not None:
        header = _parse(text)
        if header.get("op") != "void" and int(header.get("lsn", 0)) <= skip_upto:
            f.seek(blen, os.SEEK_CUR)
            return header, []
    body = f.read(blen)
    if len(body) < blen:
        raise ValueError("truncated record")
    if crc32(body, crc32(text, 0)) != crc:
        raise ValueError("checksum mismatch")
    return (header if skip_upto is not None else _parse(text)), [raw, text, body]


def _parse(text: bytes) -> dict[str, Any]:
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"unreadable record header: {exc!r}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"unreadable record header: {header!r}")
    return header


def _arrays(header: dict[str, Any], body: bytes) -> list[Array]:
    """The record's arrays (read-only views of ``body``); takes ``arrays`` out of
    the header."""
    try:
        arrays, offset = [], 0
        for dtype_str, shape in header.pop("arrays"):
            dtype = np.dtype(dtype_str)
            count = int(np.prod(shape, dtype=np.int64))
            a = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
            arrays.append(a.reshape(shape))
            offset += count * dtype.itemsize
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"unreadable record header: {exc!r}") from exc
    return arrays


def _check_segment(f: Any, path: str) -> bool:
    """Read a segment's header; False for one cut short before its header was done."""
    raw = f.read(SEGMENT_HEADER.size)
    if len(raw) < SEGMENT_HEADER.size:
        return False
    magic, version = SEGMENT_HEADER.unpack(raw)
    if magic != SEGMENT_MAGIC:
        raise WalFormatError(
            f"{path}: not an onnxps write-ahead log segment (or one written before "
            f"format version {WAL_FORMAT_VERSION}); move it out of the data directory"
        )
    if version != WAL_FORMAT_VERSION:
        raise WalFormatError(
            f"{path}: write-ahead log format version {version}, this server reads "
            f"version {WAL_FORMAT_VERSION}; use the onnxps release that wrote it"
        )
    return True


@dataclass(frozen=True)
class _Damage:
    """Where a segment's intact records end, and what follows."""

    path: str
    offset: int
    reason: str
    last_segment: bool
    records_after: int  # intact frames after it in this segment
    bytes_after: int  # from the offset to the end of this segment

    @property
    def torn(self) -> bool:
        """A crash cut the last write short: only the end of the last segment."""
        return self.last_segment and self.records_after == 0


class LogReader:
    """Every intact record with lsn > ``after``, in order (iterate once). A segment
    whose records all come at or before ``after`` (the next one starts by
    ``after + 1``) is not opened: a restart after a snapshot reads the log after it.

    A torn tail is dropped with a warning and remembered in ``torn`` so the caller
    can cut it off (``cut_torn_tail``) before writing after it. Corruption raises
    ``WalCorruptError``, or with ``truncate_corrupt`` cuts the log there (that
    segment at the offset, every later segment deleted), logged as an ERROR with
    what was dropped. A segment of another format version raises ``WalFormatError``.
    """

    def __init__(self, wal_dir: str, after: int, truncate_corrupt: bool = False):
        self.wal_dir = wal_dir
        self.after = after
        self.truncate_corrupt = truncate_corrupt
        self.torn: _Damage | None = None
        self.voided = 0  # refused records declared by the void frames read so far
        self.skipped = 0  # segments not opened: all their records were <= after

    def __iter__(self) -> Iterator[tuple[dict[str, Any], list[Array]]]:
        self._expected: int | None = None
        found = segment_paths(self.wal_dir)
        segments = [path for _, path in found]
        for k, path in enumerate(segments):
            if k + 1 < len(found) and found[k + 1][0] <= self.after + 1:
                self.skipped += 1
                continue  # every record in it is at or before ``after``: not read
            damage = yield from self._segment(path, last=k == len(segments) - 1)
            if damage is not None:
                if damage.torn:
                    self._tear(damage)
                else:
                    self._corrupt(damage, segments[k + 1 :])
                return

    def _segment(
        self, path: str, last: bool
    ) -> Generator[tuple[dict[str, Any], list[Array]], None, _Damage | None]:
        """Yield one segment's records; return what damage ends it, if any."""
        with open(path, "rb") as f:
            if not _check_segment(f, path):
                return _short_header(f, path, last)
            for header, arrays in _frames(f):
                if isinstance(header, _BadFrame):
                    return _damage(path, header, last)
                if header.get("op") == "void":
                    self._skip_void(int(header["first"]), int(header["last"]))
                    continue
                lsn = int(header["lsn"])
                if self._expected is not None and lsn != self._expected:
                    if lsn > self.after:
                        log.warning(
                            "write-ahead log %s: record %d follows %d; records are "
                            "missing",
                            path,
                            lsn,
                            self._expected - 1,
                        )
                self._expected = lsn + 1
                if lsn > self.after:
                    yield header, arrays
        return None

    def frames(self, upto: int) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
        """(header, bytes as the log holds them: prefix, header, body) of every
        record after ``after`` up to ``upto``, in order: a replicated shard's
        primary ships them to a standby. One that cannot be read (pruned, torn,
        damaged, or not in the log) raises ``WalGapError``: none is skipped.
        Segments holding none of them are not opened, the bodies of the records
        before them not read; nothing is repaired, and nothing logged."""
        self._wanted = self.after + 1  # the next record to yield
        segments = segment_paths(self.wal_dir)
        starts = [first for first, _ in segments[1:]] + [None]
        for (_, path), nxt in zip(segments, starts, strict=True):
            if self._wanted > upto:
                return
            if nxt is None or nxt > self._wanted:
                yield from self._segment_frames(path, upto)
        if self._wanted <= upto:
            raise WalGapError(
                f"record {self._wanted} is not in the log {self.wal_dir} (it ends "
                f"before it; records up to {upto} were asked for)"
            )

    def _segment_frames(
        self, path: str, upto: int
    ) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
        """``frames`` of one segment (``_expected``: the next record wanted)."""
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise WalGapError(
                f"record {self._wanted} is not in the log {self.wal_dir}: its "
                f"segment {path} was removed (pruned after a snapshot)"
            ) from None
        with f:
            if not _check_segment(f, path):
                return
            while self._wanted <= upto:
                pos = f.tell()
                try:
                    frame = _read_frame(f, skip_upto=self.after)
                except ValueError as exc:
                    raise WalGapError(
                        f"record {self._wanted} cannot be read from {path} ({exc} "
                        f"at byte {pos})"
                    ) from None
                if frame is None:
                    return
                header, raw = frame
                if header.get("op") == "void":  # refused when written: no gap
                    if int(header["first"]) <= self._wanted:
                        self._wanted = max(self._wanted, int(header["last"]) + 1)
                    continue
                lsn = int(header.get("lsn", 0))
                if lsn <= self.after:
                    continue
                if lsn != self._wanted:
                    raise WalGapError(
                        f"records {self._wanted} to {lsn - 1} are not in the log "
                        f"{self.wal_dir} (pruned after a snapshot, or lost)"
                    )
                self._wanted = lsn + 1
                yield header, raw

    def _skip_void(self, first: int, last: int) -> None:
        """Records refused when written (the disk failed): no gap in the log."""
        self.voided += last - first + 1
        if self._expected is not None and self._expected >= first:
            self._expected = max(self._expected, last + 1)

    def _tear(self, damage: _Damage) -> None:
        self.torn = damage
        log.warning(
            "write-ahead log %s: %s at byte %d, the end of the last segment: a write "
            "cut short by a crash; its %d bytes are dropped",
            damage.path,
            damage.reason,
            damage.offset,
            damage.bytes_after,
        )

    def _corrupt(self, damage: _Damage, later: list[str]) -> None:
        records = damage.records_after + sum(_count_records(p) for p in later)
        nbytes = damage.bytes_after + sum(os.path.getsize(p) for p in later)
        what = f"{_count(records, 'intact record')} and {nbytes} bytes"
        if later:
            what += f" (in this and {_count(len(later), 'later segment')})"
        where = f"{damage.path}: {damage.reason} at byte {damage.offset}"
        if not self.truncate_corrupt:
            raise WalCorruptError(
                f"corrupt write-ahead log: {where}, in the middle of the log (not a "
                f"write cut short by a crash); {what} follow it. Restore the data "
                "directory from a backup, or start with --wal-truncate-corrupt to "
                "cut the log there and lose them"
            )
        _truncate(damage.path, damage.offset)
        for p in later:
            os.unlink(p)
        fsync_dir(self.wal_dir)
        log.error(
            "corrupt write-ahead log: %s; truncated the log there "
            "(--wal-truncate-corrupt): dropped %s",
            where,
            what,
        )

    def cut_torn_tail(self) -> None:
        """Cut a torn tail off, so that records written after it stay readable."""
        if self.torn is not None:
            _truncate(self.torn.path, self.torn.offset)
            self.torn = None


class LogCursor:
    """Reads durable records in lsn order, each call going on where the last one
    stopped: a standby catching up costs one sequential pass over the log, not a
    parse from the segment's start per record (``LogReader.frames`` starts anew
    each time). Asked for a record before its position, it starts again from the
    segment that holds it. One that cannot be read raises ``WalGapError``."""

    def __init__(self, wal_dir: str, after: int = 0) -> None:
        self.wal_dir = wal_dir
        self.next = after + 1  # the next record it yields
        self._f: Any = None
        self._first = 0  # the first lsn of the open segment (its name)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def frames(self, upto: int) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
        """(header, frame bytes: prefix, header, body) of every record from the
        cursor's position up to ``upto`` (every one of them durable)."""
        while self.next <= upto:
            if self._f is None:
                self._open()
            pos = self._f.tell()
            try:
                frame = _read_frame(self._f, skip_upto=self.next - 1)
            except ValueError as exc:
                raise WalGapError(
                    f"record {self.next} cannot be read from {self._f.name} ({exc} "
                    f"at byte {pos})"
                ) from None
            if frame is None:
                self._next_segment(upto)
                continue
            header, raw = frame
            if header.get("op") == "void":  # refused when written: no gap
                if int(header["first"]) <= self.next:
                    self.next = max(self.next, int(header["last"]) + 1)
                continue
            lsn = int(header.get("lsn", 0))
            if lsn < self.next:
                continue
            if lsn != self.next:
                raise WalGapError(
                    f"records {self.next} to {lsn - 1} are not in the log "
                    f"{self.wal_dir} (pruned after a snapshot, or lost)"
                )
            self.next = lsn + 1
            yield header, raw

    def seek(self, after: int) -> None:
        """Go on after record ``after`` (backwards: from its segment's start)."""
        if after + 1 < self.next:
            self.close()
        self.next = after + 1

    def _open(self) -> None:
        """Open the segment holding record ``next`` (the last named at or before
        it), positioned after its header."""
        found = [(f, p) for f, p in segment_paths(self.wal_dir) if f <= self.next]
        if not found:
            raise WalGapError(
                f"record {self.next} is not in the log {self.wal_dir}: its segment "
                "was removed (pruned after a snapshot)"
            )
        self._open_path(*found[-1])

    def _open_path(self, first: int, path: str) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 - kept open across calls
        except FileNotFoundError:
            raise WalGapError(
                f"record {self.next} is not in the log {self.wal_dir}: its segment "
                f"{path} was removed (pruned after a snapshot)"
            ) from None
        if not _check_segment(f, path):
            f.close()
            raise WalGapError(f"record {self.next}: segment {path} has no header")
        self._f, self._first = f, first

    def _next_segment(self, upto: int) -> None:
        """At the end of the open segment: the one after it."""
        later = [(f, p) for f, p in segment_paths(self.wal_dir) if f > self._first]
        path = self._f.name
        self.close()
        if not later:
            raise WalGapError(
                f"record {self.next} is not in the log {self.wal_dir} (it ends at "
                f"{path}; records up to {upto} were asked for)"
            )
        self._open_path(*later[0])


def read_segments(
    wal_dir: str, after: int, truncate_corrupt: bool = False
) -> Iterator[tuple[dict[str, Any], list[Array]]]:
    """Every intact record with lsn > ``after``, in order (see ``LogReader``)."""
    return iter(LogReader(wal_dir, after, truncate_corrupt))


@dataclass(frozen=True)
class _BadFrame:
    offset: int
    reason: str


def _frames(f: Any) -> Iterator[tuple[Any, list[Array]]]:
    """The intact records of one segment (header, arrays), then a ``_BadFrame`` if
    one is damaged."""
    while True:
        pos = f.tell()
        try:
            frame = _read_frame(f)
            if frame is None:
                return
            header, (_, _, body) = frame
            arrays = _arrays(header, body)
        except ValueError as exc:
            yield _BadFrame(pos, str(exc)), []
            return
        yield header, arrays


def _short_header(f: Any, path: str, last_segment: bool) -> _Damage | None:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        return None  # created, nothing written yet: nothing to lose
    return _Damage(path, 0, "segment header cut short", last_segment, 0, size)


def _damage(path: str, bad: _BadFrame, last_segment: bool) -> _Damage:
    size = os.path.getsize(path)
    return _Damage(
        path,
        bad.offset,
        bad.reason,
        last_segment,
        _intact_after(path, bad.offset + 1, size),
        size - bad.offset,
    )


def _intact_frame_end(buf: Any, pos: int, size: int) -> int | None:
    """The end of an intact frame starting at ``pos`` (its CRC matches), else None."""
    if pos + FRAME.size > size:
        return None
    magic, hlen, blen, crc = FRAME.unpack_from(buf, pos)
    end = pos + FRAME.size + hlen + blen
    if magic != MAGIC or hlen > MAX_HEADER or end > size:
        return None
    view = memoryview(buf)
    try:
        if crc32(view[pos + FRAME.size : end], 0) != crc:
            return None
    finally:
        view.release()
    return int(end)


def _intact_after(path: str, start: int, size: int) -> int:
    """How many intact frames follow ``start``: the first found by its magic, then
    each right after the one before."""
    if start >= size:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = m.find(MAGIC, start)
        while pos >= 0:
            end = _intact_frame_end(m, pos, size)
            if end is not None:
                count = 1
                while (end := _intact_frame_end(m, end, size) or 0) > 0:
                    count += 1
                return count
            pos = m.find(MAGIC, pos + 1)
    return 0


def _count_records(path: str) -> int:
    with open(path, "rb") as f:
        try:
            if not _check_segment(f, path):
                return 0
        except WalFormatError:
            return 0
        return sum(1 for h, _ in _frames(f) if not isinstance(h, _BadFrame))


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


def _truncate(path: str, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def logged_term(wal_dir: str, lsn: int) -> int | None:
    """The term record ``lsn`` of the log holds (0: none written), or None when
    the log does not hold that record (pruned, not written, or damaged). Reads the
    headers of the one segment holding it, none of the bodies before it."""
    try:
        for header, _ in LogReader(wal_dir, lsn - 1).frames(upto=lsn):
            return int(header.get("term", 0))
    except (WalGapError, WalFormatError, OSError):
        return None
    return None
