"""The write-ahead log: framed records, group commit and segments.

A record is a JSON header plus the raw bytes of its arrays, in one frame
(docs/FORMAT.md, ``_walread``).

``log`` is called under a group's lock and only enqueues; the first caller of
``wait`` that finds nobody writing becomes the writer: it writes every queued frame
and fsyncs once for the whole batch (group commit: records of other groups queued
meanwhile go in the same or the next batch), then wakes the other callers (a
background thread flushes what nobody waits for, such as a segment rotation).
``wait`` raises for a record that could not be written, and the caller then applies
nothing: ``WalDiskFullError`` (RESOURCE_EXHAUSTED, ``DISK_FULL``) when the disk or
the file size limit is full, at once and not worth a resend (as etcd's NOSPACE
alarm, but lifted by itself: every later batch tries again, so writes resume once
there is room), ``WalWriteError`` (UNAVAILABLE) for any other failure. A failed
write is cut off again (``ftruncate`` to the last fsynced size), so the log never
holds a torn frame in its middle, and the next batch tries again; the refused lsns
are declared by a ``void`` frame. A failed fsync stops the log for good (the kernel
may have dropped the pages): every later record is refused until a restart. So
does a segment no longer on disk at its path (the data directory removed or moved
under the running server: checked after every fsync, before any record of the
batch is acknowledged): ``WalUnlinkedError`` (FAILED_PRECONDITION,
``WAL_UNLINKED``), as none of those changes would survive a restart.

Records are numbered by their lsn (log sequence number, consecutive across segments
and restarts); the log is cut into segments named by the lsn of their first record,
so segments a snapshot covers can be deleted. The format and the reader are in
``_walread``.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FailedPrecondition, NotLogged, ResourceExhausted, Unavailable
from ._walread import (
    FRAME,
    MAGIC,
    MAX_HEADER,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    WAL_FORMAT_VERSION,
    LogReader,
    WalCorruptError,
    WalFormatError,
    WalGapError,
    crc32,
    fsync_dir,
    read_segments,
    segment_name,
    segment_paths,
)

__all__ = [
    "FRAME",
    "MAGIC",
    "MAX_HEADER",
    "SEGMENT_HEADER",
    "SEGMENT_MAGIC",
    "WAL_FORMAT_VERSION",
    "Frame",
    "FsyncTimes",
    "LogReader",
    "WalCorruptError",
    "WalDiskFullError",
    "WalFormatError",
    "WalGapError",
    "WalUnlinkedError",
    "WalWriteError",
    "WriteAheadLog",
    "c_order",
    "fsync_dir",
    "read_segments",
    "segment_name",
    "segment_paths",
]

log = logging.getLogger("onnxps.durability")

Array = np.ndarray[Any, Any]

IDLE_CHECK_SECONDS = 1.0  # how often an idle log checks its segment is on disk


class FsyncTimes:
    """How long the log's fsyncs took: a histogram kept by the one thread that
    writes batches, read (a copy) by the metrics when scraped."""

    BOUNDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.BOUNDS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.BOUNDS, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def buckets(self) -> tuple[list[tuple[float, int]], float]:
        """(upper bound, cumulative count) per bucket, +Inf last; and the sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = list(itertools.accumulate(counts))
        bounds = [*self.BOUNDS, float("inf")]
        return list(zip(bounds, cumulative, strict=True)), total


class WalWriteError(Unavailable, NotLogged):
    """A record could not be written: the change it carries was not applied."""

    default_reason = "WAL_WRITE_FAILED"


class WalDiskFullError(ResourceExhausted, NotLogged):
    """No room for a record (disk, quota or file size limit full): the change was
    not applied, and a resend fails alike until there is room."""

    default_reason = "DISK_FULL"


class WalUnlinkedError(FailedPrecondition, NotLogged):
    """The log's segment is no longer on disk at its path: the change was not
    applied, and none is until the server is restarted on a data directory."""

    default_reason = "WAL_UNLINKED"


# Errors that mean "no room": the write may pass once space is freed.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class _Unlinked(OSError):
    """The segment being written is not the file at its path any more."""


def c_order(a: Array) -> Array:
    """``a`` as a C-ordered array of the same shape (no copy when it is one already).
    Not ``np.ascontiguousarray``: that returns at least one dimension, so a 0-d
    tensor would be saved as shape (1,) and no longer match its group."""
    return np.asarray(a, order="C")


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Frame:
    """One record's frame as the log holds it: the bytes ``chunks()`` returns are
    the bytes written, and the bytes a replicated shard's primary ships (its CRC is
    computed once, by whichever of the two needs it first)."""

    def __init__(self, header: bytes, arrays: Sequence[Array] = ()) -> None:
        self.header = header
        self.bodies = [a.reshape(-1).data.cast("B") for a in arrays if a.nbytes]
        self.nbytes = FRAME.size + len(header) + sum(len(b) for b in self.bodies)
        self._lock = threading.Lock()
        self._prefix: bytes | None = None

    def chunks(self) -> list[Any]:
        """The frame's bytes in order (its prefix, header and array bodies)."""
        with self._lock:
            if self._prefix is None:
                crc = crc32(self.header, 0)
                for body in self.bodies:
                    crc = crc32(body, crc)
                size = self.nbytes - FRAME.size - len(self.header)
                self._prefix = FRAME.pack(MAGIC, len(self.header), size, crc)
        return [self._prefix, self.header, *self.bodies]


class _Received(Frame):
    """A frame received (a standby's copy of its primary's record: whole, or its
    pieces in order), its CRC and lsn checked by the receiver: written as it is."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw if isinstance(raw, list) else [raw]
        self.nbytes = sum(len(c) for c in self.raw)

    def chunks(self) -> list[Any]:
        return self.raw


@dataclass
class _Item:
    lsn: int
    frame: Frame | None = None
    rotate_to: int | None = None  # start a new segment whose first record is this


class WriteAheadLog:
    """The store's journal in ``--durability wal`` mode.

    ``on_error(exc)`` is called after every failed batch, ``on_recover()`` when a
    batch is written again after a failure.
    """

    def __init__(
        self,
        wal_dir: str,
        next_lsn: int,
        on_error: Callable[[OSError], None] | None = None,
        on_recover: Callable[[], None] | None = None,
    ) -> None:
        self.wal_dir = wal_dir
        self._cv = threading.Condition(threading.Lock())
        self._last = next_lsn - 1  # last lsn handed out
        self._done = next_lsn - 1  # every lsn up to this one is durable or failed
        self._durable = next_lsn - 1  # the last lsn written and fsynced
        self._failures: dict[int, OSError] = {}  # failed lsns not yet waited for
        self._queue: list[_Item] = []
        self._writing = False  # a thread is writing a batch
        self._closing = False
        self._broken: OSError | None = None  # no more writes until a restart
        self._failing = False  # the last batch failed
        self._fsync_failed = False
        self._stop_reported = False
        self._voids: list[tuple[int, int]] = []  # refused lsns to declare (<= 1)
        self._synced = 0  # bytes of the current segment known to be durable
        self._path = ""  # the current segment's path, and its (st_dev, st_ino)
        self._ident = (0, 0)
        self._last_error: OSError | None = None
        self._on_error = on_error
        self._on_recover = on_recover
        self.fsync_times = FsyncTimes()  # read by the metrics at scrape time
        # A segment already named after next_lsn holds no intact record (else replay
        # would have moved next_lsn past it): only a torn write, which is dropped.
        self._fd = self._open_segment(next_lsn, truncate=True)
        self._thread = threading.Thread(
            target=self._run, name="onnxps-wal", daemon=True
        )
        self._thread.start()

    # -- the Journal protocol -------------------------------------------------------
    def log(self, record: dict[str, Any], arrays: Sequence[Array]) -> int:
        """Queue ``record``; its lsn is the next one."""
        return self.log_frame(record, arrays)[0]

    def log_frame(
        self, record: dict[str, Any], arrays: Sequence[Array]
    ) -> tuple[int, Frame]:
        """``log``, returning the frame queued too (the bytes the log will hold)."""
        arrays = [c_order(a) for a in arrays]
        with self._cv:
            self._check_open()
            self._last += 1
            lsn = self._last
            header = {
                **record,
                "lsn": lsn,
                # when it was logged: a group's history lists its steps' times
                "unix": round(time.time(), 3),
                "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
            }
            frame = Frame(json.dumps(header).encode(), arrays)
            self._queue.append(_Item(lsn, frame))  # the caller's wait writes it
        return lsn, frame

    def append_frame(self, raw: Any, lsn: int) -> int:
        """Queue a whole frame as it is (or its pieces, in a list): a standby's copy
        of its primary's record ``lsn`` (the caller checked its CRC and that its
        header holds ``lsn``),
        which keeps the primary's number; it must be above the last."""
        with self._cv:
            self._check_open()
            if lsn <= self._last:
                raise ValueError(
                    f"record {lsn} is not after the last one, {self._last}"
                )
            self._last = lsn
            self._queue.append(_Item(lsn, _Received(raw)))
        return lsn

    def _check_open(self) -> None:
        """Under the lock: refuse a record the log cannot take now."""
        if self._broken is not None:
            raise self._refusal(self._broken)
        if self._closing:
            raise Unavailable(
                "the write-ahead log is closed: the server is shutting down; "
                "retry once it is back"
            )

    def check_writable(self) -> None: ...  # (``Journal``) a log alone takes all

    def wait(self, lsn: int) -> None:
        """Return once record ``lsn`` is durable; WalWriteError if it is not."""
        with self._cv:
            while self._done < lsn:
                batch = self._take_batch()
                if batch is None:
                    self._cv.wait()
                    continue
                self._cv.release()
                try:
                    self._flush(batch)
                finally:
                    self._cv.acquire()
            exc = self._failures.pop(lsn, None)
        if exc is not None:
            raise self._refusal(exc)

    def _refusal(
        self, exc: OSError
    ) -> Unavailable | ResourceExhausted | FailedPrecondition:
        metadata = {"wal_dir": self.wal_dir, "errno": exc.errno or 0}
        if isinstance(exc, _Unlinked):
            return WalUnlinkedError(
                f"{exc.strerror}, so this change was not applied (it would not "
                "survive a restart), nor will any other be: the groups in memory "
                "are intact and can still be read; save them (onnxps export), "
                "restart the server on a data directory and import them",
                metadata=metadata,
            )
        if exc.errno in NO_SPACE and self._broken is None:
            return WalDiskFullError(
                f"the disk of the write-ahead log in {self.wal_dir} is full "
                f"({exc.strerror or exc}), so this change was not applied and the "
                "group is as it was; changes are refused at once until there is "
                "room again, then accepted with no restart: free space on that "
                "disk (or raise the limit), then retry",
                metadata=metadata,
            )
        then = (
            "the log stopped after a failed fsync: restart the server once the disk "
            "is fixed"
            if self._broken is not None
            else "fix that disk and retry"
        )
        return WalWriteError(
            f"the write-ahead log in {self.wal_dir} could not be written "
            f"({exc.strerror or exc}), so this change was not applied and the group "
            f"is as it was; {then}",
            metadata=metadata,
        )

    def alarm(self) -> str | None:
        """Why the log refuses changes now (the refusal's reason), or None."""
        with self._cv:
            exc = self._broken or (self._last_error if self._failing else None)
            if exc is None:
                return None
            reason: str = self._refusal(exc).reason
            return reason

    def forget_refused(self) -> int:
        """A standby's log after a batch failed (a full disk): the records it
        refused are forgotten, not declared void, since its primary sends them
        again with the same lsns; the next record appended is the one after the
        last durable one, whose lsn this returns. Raises the refusal when the log
        stopped for good (a failed fsync: restart the server)."""
        with self._cv:
            while self._writing or self._queue:
                self._cv.wait(0.05)
            if self._broken is not None:
                raise self._refusal(self._broken)
            self._last = self._done = self._durable
            self._voids = []
            self._failures.clear()
            return self._durable

    # -- control --------------------------------------------------------------------
    def last_lsn(self) -> int:
        with self._cv:
            return self._last

    def durable_lsn(self) -> int:
        """The last lsn written and fsynced."""
        with self._cv:
            return self._durable

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
        try:
            if os.fstat(fd).st_size == 0:
                _write_all(fd, SEGMENT_HEADER.pack(SEGMENT_MAGIC, WAL_FORMAT_VERSION))
                os.fsync(fd)
            fsync_dir(self.wal_dir)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._synced, self._path, self._ident = st.st_size, path, (st.st_dev, st.st_ino)
        return fd

    def _run(self) -> None:
        """Flush what no caller waits for (rotations), drain the queue at close, and
        check the segment is still on disk while nobody writes (so health says so
        with no change in flight)."""
        check_at = time.monotonic() + IDLE_CHECK_SECONDS
        while True:
            with self._cv:
                batch = self._take_batch()
                while batch is None:
                    if self._closing and not self._queue and not self._writing:
                        return
                    if not self._writing and time.monotonic() >= check_at:
                        self._writing = True  # the writer's role, for the check
                        break
                    self._cv.wait(timeout=0.05)
                    batch = self._take_batch()
            if batch is None:
                self._idle_check()
                check_at = time.monotonic() + IDLE_CHECK_SECONDS
                continue
            self._flush(batch)

    def _idle_check(self) -> None:
        """``_check_on_disk`` as the writer, with nothing written: the log stops
        (and says so) when its segment is gone."""
        try:
            if self._broken is None and self._fd >= 0:
                try:
                    self._check_on_disk(os.fstat(self._fd))
                except _Unlinked as exc:
                    self._broken = exc
                    news = self._account(exc, [])
                    if news is not None:
                        news()
                except OSError:
                    pass  # anything else is for the next write to find
        finally:
            with self._cv:
                self._writing = False
                self._cv.notify_all()

    def _take_batch(self) -> list[_Item] | None:
        """Under the lock: the queue, to write, unless another thread is writing."""
        if self._writing or not self._queue:
            return None
        self._writing = True
        batch, self._queue = self._queue, []
        return batch

    def _flush(self, batch: list[_Item]) -> None:
        """Write a batch taken by ``_take_batch`` (without the lock), publish it."""
        written, exc = 0, self._broken
        try:
            if exc is None:
                written, exc = self._write_batch(batch)
            failed = [item.lsn for item in batch[written:] if item.frame is not None]
            # Announced while still the only writer, so health changes in order.
            news = self._account(exc, failed)
            if news is not None:
                news()
        finally:
            with self._cv:
                for item in batch[written:]:
                    if item.frame is not None:
                        self._failures[item.lsn] = exc or OSError("log write failed")
                if written:
                    self._durable = max(self._durable, batch[written - 1].lsn)
                self._done = max(self._done, batch[-1].lsn)
                self._writing = False
                self._cv.notify_all()

    def _write_batch(self, batch: list[_Item]) -> tuple[int, OSError | None]:
        """Write and fsync ``batch``: (how many of its items are durable, the error)."""
        durable = 0
        try:
            for first, last in self._voids:
                void = {"op": "void", "first": first, "last": last, "arrays": []}
                self._write_frame(Frame(json.dumps(void).encode()))
            for i, item in enumerate(batch):
                if item.rotate_to is None:
                    assert item.frame is not None
                    self._write_frame(item.frame)
                    continue
                self._sync()
                durable = i
                os.close(self._fd)
                self._fd = -1
                try:
                    self._fd = self._open_segment(item.rotate_to)
                except FileNotFoundError as exc:
                    raise _Unlinked(
                        errno.ENOENT,
                        f"the write-ahead log directory {self.wal_dir} is gone (the "
                        "data directory was removed under the running server)",
                    ) from exc
                durable = i + 1
            self._sync()
            return len(batch), None
        except OSError as exc:
            self._discard_unsynced(exc)
            return durable, exc

    def _write_frame(self, frame: Frame) -> None:
        for chunk in frame.chunks():
            _write_all(self._fd, chunk)

    def _sync(self) -> None:
        start = time.perf_counter()
        try:
            os.fsync(self._fd)
        except OSError:
            self._fsync_failed = True
            raise
        self.fsync_times.observe(time.perf_counter() - start)
        st = os.fstat(self._fd)
        self._check_on_disk(st)
        self._synced = st.st_size
        self._voids = []  # written first in the batch: durable now

    def _check_on_disk(self, st: os.stat_result) -> None:
        """The segment just fsynced is still the file at its path: else what it
        holds is gone at the next restart (``rm -rf`` of the data directory, or the
        directory moved), and nothing written to it may be acknowledged."""
        try:
            now = os.stat(self._path)
            here = (now.st_dev, now.st_ino) == self._ident
        except FileNotFoundError:
            here = False
        if st.st_nlink == 0 or not here:
            raise _Unlinked(
                errno.ENOENT,
                f"the write-ahead log segment {self._path} is no longer on disk at "
                "that path (the data directory was removed or moved under the "
                "running server)",
            )

    def _discard_unsynced(self, exc: OSError) -> None:
        """Cut the segment back to its fsynced size: no torn frame stays in the middle
        of the log. After a failed fsync (or when this fails) the log stops."""
        if self._fd < 0 or self._fsync_failed:
            self._broken = exc
            return
        try:
            # A segment moved away keeps its file: it must not hold a refused record.
            os.ftruncate(self._fd, self._synced)
            os.fsync(self._fd)
        except OSError as again:
            self._broken = again
        if isinstance(exc, _Unlinked):
            self._broken = exc

    def _account(
        self, exc: OSError | None, failed: list[int]
    ) -> Callable[[], None] | None:
        """Update the failure state after a batch (as its writer); returns what to
        announce (log lines, health callbacks)."""
        if exc is None:
            if not self._failing:
                return None
            self._failing = False
            return self._announce_recovery
        self._last_error = exc
        if failed and self._broken is None:
            # No batch succeeded since the pending voids: every lsn between them
            # was refused, so one range declares them all.
            first = self._voids[0][0] if self._voids else failed[0]
            self._voids = [(first, failed[-1])]
        stopped = self._broken is not None and not self._stop_reported
        first_failure = not self._failing or stopped
        self._stop_reported = self._broken is not None
        self._failing = True
        stopped_now = self._broken is not None

        refusal = self._refusal(exc)
        if stopped_now and refusal.reason == "WAL_UNLINKED":
            then = "and the log stopped: export the groups, restart on a data directory"
        elif stopped_now:
            then = "and the log stopped: restart the server once the disk is fixed"
        elif refusal.reason == "DISK_FULL":
            then = "until there is room on that disk (writes resume by themselves)"
        else:
            then = "until it can write again"

        def announce() -> None:
            if first_failure:
                log.error(
                    "write-ahead log in %s failed: %s; the changes it could not log "
                    "are refused (reason %s) and not applied, %s",
                    self.wal_dir,
                    exc,
                    refusal.reason,
                    then,
                )
            if self._on_error is not None:
                assert exc is not None
                self._on_error(exc)

        return announce

    def _announce_recovery(self) -> None:
        log.warning(
            "write-ahead log in %s is written again; pushes are durable again",
            self.wal_dir,
        )
        if self._on_recover is not None:
            self._on_recover()
