"""A log record as a WAL frame (docs/FORMAT.md): shipped as the log holds it, in
pieces of at most 1 MiB (``pieces``) or several whole in one message (``batch``),
gathered (``Gather``), checked and written as it came by the standby."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import _read_varint, _varint

from ..durability._wal import Frame
from ..durability._walread import (
    FRAME,
    MAGIC,
    MAX_HEADER,
    LogReader,
    WalFormatError,
    WalGapError,
    crc32,
)

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class ShippedRecord:
    """A ``ReplicateResponse`` carrying a record, as the standby's stub decodes it:
    the frame is a view of the received message (no copy). Gathered from pieces
    (``Gather``), ``frame`` is the first piece, ``rest`` the others as they came
    and ``crc`` the CRC of the frame's bytes after its prefix, computed piece by
    piece as they came (``check_frame`` compares it with the prefix's)."""

    term: int
    lsn: int
    frame: memoryview
    rest: tuple[memoryview, ...] = ()
    crc: int | None = None

    def __len__(self) -> int:
        return len(self.frame) + sum(len(p) for p in self.rest)

    def chunks(self) -> list[memoryview]:
        """The frame's bytes in order, as received (written so to the log)."""
        return [self.frame, *self.rest]

    def whole(self) -> memoryview:
        """The frame in one buffer: its pieces copied into a 16-byte-aligned one
        (by the applier, after the ack: not on the way to it)."""
        if not self.rest:
            return self.frame
        buf = np.empty(len(self), np.uint8)
        at = 0
        for p in self.chunks():
            buf[at : at + len(p)] = np.frombuffer(p, np.uint8)
            at += len(p)
        return buf.data


@dataclass(frozen=True)
class ShippedBatch:
    """A ``ReplicateResponse`` carrying several whole records (``records``, log
    shipping protocol 2), as the standby's stub decodes it: each frame a view of
    the received message."""

    term: int
    records: tuple[ShippedRecord, ...]


PIECE = 1 << 20  # frame bytes per message (the first one holds the header whole)
# The log shipping protocol this version speaks (``ReplicateHello.protocol``): 1,
# records in pieces of PIECE bytes; a standby speaking 0 takes them whole (WHOLE);
# 2, several whole records in one message (``batch``) as well.
PROTOCOL = 2
BATCHES = 2  # the protocol from which a standby takes ``batch`` messages
WHOLE = 1 << 62
# Bytes a record adds to a batch beside its frame (its tags and lengths), at most
BATCH_OVERHEAD = 32


def batch(term: int, records: Sequence[tuple[int, Sequence[Any]]]) -> bytes:
    """The wire bytes of ``ReplicateResponse(term, records=ReplicaRecordBatch(
    [ReplicaRecord(lsn, frame), ...]))`` for ``records``, (lsn, the frame's bytes
    in chunks) in lsn order, each frame whole: one message, one copy."""
    parts: list[Any] = []
    size = 0
    for lsn, chunks in records:
        frame = sum(len(memoryview(c).cast("B")) for c in chunks)
        record = b"\x08" + _varint(lsn) + b"\x12" + _varint(frame)
        head = b"\x0a" + _varint(len(record) + frame) + record
        parts.append(head)
        parts.extend(chunks)
        size += len(head) + frame
    head = b"\x2a" + _varint(size)
    if term:
        head = b"\x08" + _varint(term) + head
    return b"".join([head, *parts])


def pieces(
    term: int, lsn: int, chunks: Sequence[Any], start: int = 0, size: int = PIECE
) -> Iterator[bytes]:
    """The messages shipping a frame (``chunks`` joined) from byte ``start``: each
    the wire bytes of ``ReplicateResponse(term, record=ReplicaRecord(lsn, piece))``,
    the pieces in order. A piece is copied as its message is sent (a 64 MiB record
    is never joined whole: fresh 64 MiB buffers cost their page faults, twice on
    each side); the standby gathers them (``Gather``)."""
    offset: int | None = start
    while offset is not None:
        message, offset = piece(term, lsn, chunks, offset, size)
        yield message


def piece(
    term: int, lsn: int, chunks: Sequence[Any], offset: int, size: int = PIECE
) -> tuple[bytes, int | None]:
    """The message carrying the frame's piece at ``offset`` (``size`` bytes at
    most), and the next piece's offset (None after the last). The first piece
    holds the frame's prefix and header whole, at least."""
    views = [memoryview(c).cast("B") for c in chunks]
    total = sum(len(v) for v in views)
    end = offset + size
    if offset == 0:
        prefix = b"".join(_slices(views, 0, FRAME.size))
        end = max(end, FRAME.size + FRAME.unpack(prefix)[1])
    end = min(end, total)
    parts = _slices(views, offset, end)
    size = end - offset
    record = b"\x08" + _varint(lsn) + b"\x12" + _varint(size)
    head = b"\x22" + _varint(len(record) + size) + record
    if term:
        head = b"\x08" + _varint(term) + head
    return b"".join([head, *parts]), (end if end < total else None)


class KeptFrame:
    """A record's frame as the primary's log holds it, kept for its streams:
    shipped in pieces (``piece``) or whole in a batch (``whole``), copied as they
    are sent, by every stream that sends it, until ``release``."""

    def __init__(self, term: int, lsn: int, frame: Frame) -> None:
        self._args: tuple[int, int, Frame] | None = (term, lsn, frame)
        self._lock = threading.Lock()
        self.nbytes = frame.nbytes

    def piece(self, offset: int, size: int) -> tuple[bytes, int | None] | None:
        """The message of the piece at ``offset`` and the next one's offset (see
        ``piece``); None once released (the frame's arrays are given back:
        the rest is read from the log)."""
        with self._lock:  # ``release`` waits for a piece being copied
            if self._args is None:
                return None
            term, lsn, frame = self._args
            return piece(term, lsn, frame.chunks(), offset, size)

    def whole(self) -> list[bytes] | None:
        """The frame's bytes, copied (for a batch); None once released."""
        with self._lock:
            if self._args is None:
                return None
            return [b"".join(self._args[2].chunks())]

    def release(self) -> None:
        """Let the frame's arrays go: no piece is copied from them after this."""
        with self._lock:
            self._args = None


def _slices(views: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """Views of bytes ``start`` to ``end`` of ``views`` joined."""
    out, base = [], 0
    for v in views:
        lo, hi = max(start - base, 0), min(end - base, len(v))
        if lo < hi:
            out.append(v[lo:hi])
        base += len(v)
    return out


class Gather:
    """A standby's record, its pieces gathered as they arrive (kept as they came,
    not copied: the log writes them in turn, and the applier joins them after the
    ack), the CRC computed piece by piece; nothing is written until it is whole and
    checked. A record shipped in one piece passes as it came."""

    def __init__(self, limit: int) -> None:
        self._limit = limit  # the most bytes a frame may have (a message's limit)
        self._pieces: list[memoryview] = []
        self._size = 0  # the frame's, once its first piece came
        self._lsn = 0
        self._got = 0
        self._crc = 0

    def add(self, rec: ShippedRecord) -> ShippedRecord | None:
        """The record once whole (None while pieces are missing); ValueError when
        a piece does not fit (another record before this one is whole)."""
        if not self._pieces:
            if len(rec.frame) < FRAME.size:
                raise ValueError(f"record {rec.lsn}: a piece of {len(rec.frame)} bytes")
            _magic, hlen, blen, _crc = FRAME.unpack_from(rec.frame)
            size = FRAME.size + hlen + blen
            if size <= len(rec.frame):
                return rec  # whole (check_frame checks its lengths)
            if len(rec.frame) < FRAME.size + hlen or size > self._limit:
                raise ValueError(
                    f"record {rec.lsn}: a frame of {size} bytes (at most "
                    f"{self._limit}) whose first piece holds {len(rec.frame)}: not "
                    "its prefix and header whole, or too long"
                )
            self._size, self._lsn, self._got = size, rec.lsn, len(rec.frame)
            self._crc = crc32(rec.frame[FRAME.size :], 0)
            self._pieces = [rec.frame]
            return None
        end = self._got + len(rec.frame)
        if rec.lsn != self._lsn or end > self._size:
            raise ValueError(
                f"record {self._lsn}: {self._got} of its {self._size} bytes came, "
                f"then {len(rec.frame)} of record {rec.lsn}"
            )
        self._crc = crc32(rec.frame, self._crc)
        self._pieces.append(rec.frame)
        self._got = end
        if end < self._size:
            return None
        first, *rest = self._pieces
        self._pieces = []
        return ShippedRecord(rec.term, rec.lsn, first, tuple(rest), self._crc)


def decode_response(raw: bytes) -> Any:
    """The standby's deserializer of ``ReplicateResponse``: a record as a
    ``ShippedRecord``, several as a ``ShippedBatch`` (their frames views of
    ``raw``), anything else parsed."""
    got = _record_view(memoryview(raw))
    return pb.ReplicateResponse.FromString(raw) if got is None else got


def _record_view(buf: memoryview) -> ShippedRecord | ShippedBatch | None:
    """``buf`` as ``piece`` or ``batch`` encodes it (a term, then a record or a
    batch of them), else None."""
    end, term, pos = len(buf), 0, 0
    if end and buf[0] == 0x08:
        term, pos = _read_varint(buf, 1, end)
    if pos >= end or buf[pos] not in (0x22, 0x2A):
        return None
    tag = buf[pos]
    length, pos = _read_varint(buf, pos + 1, end)
    if term < 0 or length < 0 or pos + length != end or pos >= end:
        return None
    if tag == 0x22:
        got = _record_at(buf, pos, end)
        return None if got is None else ShippedRecord(term, *got)
    records = []
    while pos < end:
        if buf[pos] != 0x0A:
            return None
        length, pos = _read_varint(buf, pos + 1, end)
        if length <= 0 or pos + length > end:
            return None
        got = _record_at(buf, pos, pos + length)
        if got is None:
            return None
        records.append(ShippedRecord(term, *got))
        pos += length
    return ShippedBatch(term, tuple(records)) if records else None


def _record_at(buf: memoryview, pos: int, end: int) -> tuple[int, memoryview] | None:
    """(lsn, frame) of the ``ReplicaRecord`` that ``buf[pos:end]`` holds as
    ``piece`` and ``batch`` encode it (the lsn, then the frame), else None."""
    if pos >= end or buf[pos] != 0x08:
        return None
    lsn, pos = _read_varint(buf, pos + 1, end)
    if lsn < 0 or pos >= end or buf[pos] != 0x12:
        return None
    size, pos = _read_varint(buf, pos + 1, end)
    if size < 0 or pos + size != end:
        return None
    return lsn, buf[pos:end]


def check_frame(frame: memoryview | ShippedRecord, lsn: int) -> dict[str, Any]:
    """The header of a shipped frame (whole, or a gathered record) once its
    lengths and CRC are right and it is record ``lsn``; ValueError when it is
    damaged or another record."""
    rec = frame if isinstance(frame, ShippedRecord) else ShippedRecord(0, lsn, frame)
    first = rec.frame
    if len(first) < FRAME.size:
        raise ValueError(f"record {lsn}: a frame of {len(first)} bytes")
    magic, hlen, blen, crc = FRAME.unpack_from(first)
    if (
        magic != MAGIC
        or hlen > MAX_HEADER
        or FRAME.size + hlen + blen != len(rec)
        or FRAME.size + hlen > len(first)
    ):
        raise ValueError(f"record {lsn}: bad frame magic or lengths")
    got = crc32(first[FRAME.size :], 0) if rec.crc is None else rec.crc
    if got != crc:
        raise ValueError(f"record {lsn}: checksum mismatch")
    header: dict[str, Any] = json.loads(bytes(first[FRAME.size : FRAME.size + hlen]))
    if int(header.get("lsn", -1)) != lsn:
        raise ValueError(f"record {lsn} holds lsn {header.get('lsn')}")
    return header


def frame_arrays(header: dict[str, Any], frame: memoryview) -> list[Array]:
    """The arrays of a checked frame (views of it) as its header declares them."""
    offset = FRAME.size + FRAME.unpack_from(frame)[1]
    arrays = []
    for dtype_str, shape in header["arrays"]:
        dtype = np.dtype(dtype_str)
        count = math.prod(int(n) for n in shape)
        a = np.frombuffer(frame, dtype=dtype, count=count, offset=offset)
        arrays.append(a.reshape(shape))
        offset += count * dtype.itemsize
    return arrays


# What reading records back from the log may raise: none is skipped, the reader
# raises (a record pruned, torn or damaged, a segment removed or unreadable).
UNREADABLE = (WalGapError, WalFormatError, OSError)


def logged_frames(
    wal_dir: str, after: int, upto: int
) -> Iterator[tuple[int, list[bytes]]]:
    """(lsn, frame bytes in chunks) of every record after ``after`` up to ``upto``
    as the log on disk holds them (``LogReader.frames``); one that cannot be read
    raises (``UNREADABLE``)."""
    for header, chunks in LogReader(wal_dir, after).frames(upto):
        yield int(header["lsn"]), chunks
