"""The write-ahead log: framed records, group commit, segments, and reading back.

A record is a JSON header plus the raw bytes of its arrays. A segment starts with
``b"ONNXPSWL" | u32 format version`` and then holds one frame per record (see
docs/FORMAT.md)::

    magic b"OPSW" | u32 header length | u64 body length | u32 crc32 | header | body

``log`` is called under a group's lock and only enqueues; one writer thread writes
every queued frame and fsyncs once for the whole batch (group commit), then wakes the
callers blocked in ``wait``. Records are numbered by their lsn (log sequence number,
consecutive across segments and restarts); the log is cut into segments named by the
lsn of their first record, so segments a snapshot covers can be deleted.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "WAL_FORMAT_VERSION",
    "WalFormatError",
    "WriteAheadLog",
    "c_order",
    "read_segments",
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


class WalFormatError(Exception):
    """A log segment this server cannot read; the message names the file."""


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


def c_order(a: Array) -> Array:
    """``a`` as a C-ordered array of the same shape (no copy when it is one already).

    Not ``np.ascontiguousarray``: that returns at least one dimension, so a 0-d
    tensor would be saved as shape (1,) and no longer match its group.
    """
    return np.asarray(a, order="C")


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass
class _Item:
    lsn: int
    header: bytes | None = None
    arrays: Sequence[Array] = ()
    rotate_to: int | None = None  # start a new segment whose first record is this


class WriteAheadLog:
    """The store's journal in ``--durability wal`` mode."""

    def __init__(
        self,
        wal_dir: str,
        next_lsn: int,
        on_error: Callable[[OSError], None] | None = None,
    ) -> None:
        self.wal_dir = wal_dir
        self._cv = threading.Condition(threading.Lock())
        self._last = next_lsn - 1  # last lsn handed out
        self._durable = next_lsn - 1
        self._queue: list[_Item] = []
        self._closing = False
        self._failed: OSError | None = None
        self._on_error = on_error
        # A segment already named after next_lsn holds no intact record (else replay
        # would have moved next_lsn past it): only a torn write, which is dropped.
        self._fd = self._open_segment(next_lsn, truncate=True)
        self._thread = threading.Thread(
            target=self._run, name="onnxps-wal", daemon=True
        )
        self._thread.start()

    # -- the Journal protocol -------------------------------------------------------
    def log(self, record: dict[str, Any], arrays: Sequence[Array]) -> int:
        arrays = [c_order(a) for a in arrays]
        with self._cv:
            self._last += 1
            lsn = self._last
            header = {
                **record,
                "lsn": lsn,
                "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
            }
            item = _Item(lsn, json.dumps(header).encode(), arrays)
            self._queue.append(item)
            self._cv.notify_all()
        return lsn

    def wait(self, lsn: int) -> None:
        with self._cv:
            while self._durable < lsn and self._failed is None:
                self._cv.wait()

    # -- control --------------------------------------------------------------------
    def last_lsn(self) -> int:
        with self._cv:
            return self._last

    def rotate(self) -> int:
        """Start a new segment; returns the lsn of the last record before it."""
        with self._cv:
            last = self._last
            self._queue.append(_Item(last, rotate_to=last + 1))
            self._cv.notify_all()
        return last

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- the writer thread ----------------------------------------------------------
    def _open_segment(self, first_lsn: int, truncate: bool = False) -> int:
        path = os.path.join(self.wal_dir, segment_name(first_lsn))
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        fd = os.open(path, flags | (os.O_TRUNC if truncate else 0), 0o644)
        if os.fstat(fd).st_size == 0:
            _write_all(fd, SEGMENT_HEADER.pack(SEGMENT_MAGIC, WAL_FORMAT_VERSION))
            os.fsync(fd)
        fsync_dir(self.wal_dir)
        return fd

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                batch, self._queue = self._queue, []
                if not batch and self._closing:
                    return
            if self._failed is None:
                try:
                    self._write_batch(batch)
                except OSError as exc:
                    self._fail(exc)
            with self._cv:
                self._durable = max(self._durable, batch[-1].lsn)
                self._cv.notify_all()

    def _write_batch(self, batch: list[_Item]) -> None:
        for item in batch:
            if item.rotate_to is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
                self._fd = self._open_segment(item.rotate_to)
                continue
            assert item.header is not None
            crc = zlib.crc32(item.header)
            body_len = 0
            for a in item.arrays:
                crc = zlib.crc32(a.reshape(-1).data.cast("B"), crc)
                body_len += a.nbytes
            _write_all(self._fd, FRAME.pack(MAGIC, len(item.header), body_len, crc))
            _write_all(self._fd, item.header)
            for a in item.arrays:
                if a.nbytes:
                    _write_all(self._fd, a.reshape(-1).data.cast("B"))
        os.fsync(self._fd)

    def _fail(self, exc: OSError) -> None:
        log.error(
            "write-ahead log in %s failed: %s; serving from memory, and pushes from "
            "now on are not durable until the server restarts with a working disk",
            self.wal_dir,
            exc,
        )
        with self._cv:
            self._failed = exc
            self._cv.notify_all()
        if self._on_error is not None:
            self._on_error(exc)


def _read_frame(f: Any, path: str) -> tuple[dict[str, Any], list[Array]] | None:
    """One record, or None at a clean end; raises ValueError on a torn/bad frame."""
    raw = f.read(FRAME.size)
    if not raw:
        return None
    if len(raw) < FRAME.size:
        raise ValueError("truncated frame header")
    magic, hlen, blen, crc = FRAME.unpack(raw)
    if magic != MAGIC or hlen > MAX_HEADER:
        raise ValueError("bad frame magic or header length")
    header_bytes = f.read(hlen)
    body = f.read(blen)
    if len(header_bytes) < hlen or len(body) < blen:
        raise ValueError("truncated record")
    if zlib.crc32(body, zlib.crc32(header_bytes)) != crc:
        raise ValueError("checksum mismatch")
    header = json.loads(header_bytes)
    arrays, offset = [], 0
    for dtype_str, shape in header.pop("arrays"):
        dtype = np.dtype(dtype_str)
        count = int(np.prod(shape, dtype=np.int64))
        a = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
        arrays.append(a.reshape(shape))
        offset += count * dtype.itemsize
    return header, arrays


def _check_segment(f: Any, path: str) -> bool:
    """Read a segment's header; False for one cut short before its header was done."""
    raw = f.read(SEGMENT_HEADER.size)
    if len(raw) < SEGMENT_HEADER.size:
        if raw:
            log.warning("write-ahead log %s: header cut short; no records", path)
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


def read_segments(
    wal_dir: str, after: int
) -> Iterator[tuple[dict[str, Any], list[Array]]]:
    """Every intact record with lsn > ``after``, in order.

    A segment ends at its first torn or damaged frame (a crash mid-write leaves one
    at the end of the segment being written); the next segment goes on from there.
    A segment of another format version raises ``WalFormatError``.
    """
    expected: int | None = None
    for _, path in segment_paths(wal_dir):
        with open(path, "rb") as f:
            if not _check_segment(f, path):
                continue
            for header, arrays in _frames(f, path):
                lsn = int(header["lsn"])
                if expected is not None and lsn != expected and lsn > after:
                    log.warning(
                        "write-ahead log %s: record %d follows %d; records are missing",
                        path,
                        lsn,
                        expected - 1,
                    )
                expected = lsn + 1
                if lsn > after:
                    yield header, arrays


def _frames(f: Any, path: str) -> Iterator[tuple[dict[str, Any], list[Array]]]:
    """The intact frames of one segment, up to its end or its first bad frame."""
    while True:
        pos = f.tell()
        try:
            frame = _read_frame(f, path)
        except (ValueError, json.JSONDecodeError) as exc:
            log.warning(
                "write-ahead log %s: %s at byte %d; ignoring the rest of "
                "this segment (a write cut short by a crash)",
                path,
                exc,
                pos,
            )
            return
        if frame is None:
            return
        yield frame
