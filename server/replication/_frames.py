"""A log record as a WAL frame (docs/FORMAT.md), to ship and to read back."""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._wal import (
    FRAME,
    MAGIC,
    MAX_HEADER,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    _read_frame,
    c_order,
    segment_paths,
)
from ..errors import Unavailable

Array = np.ndarray[Any, Any]


def encode_frame(record: dict[str, Any], lsn: int, arrays: Sequence[Array]) -> bytes:
    """The frame the log holds for ``record`` numbered ``lsn`` (a copy of the bytes)."""
    arrays = [c_order(a) for a in arrays]
    header = json.dumps(
        {**record, "lsn": lsn, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    ).encode()
    body = [a.reshape(-1).data.cast("B") for a in arrays if a.nbytes]
    crc = zlib.crc32(header)
    for part in body:
        crc = zlib.crc32(part, crc)
    size = sum(len(part) for part in body)
    return b"".join([FRAME.pack(MAGIC, len(header), size, crc), header, *body])


def decode_frame(frame: bytes) -> tuple[dict[str, Any], list[Array]]:
    """Header (with ``lsn``) and arrays of a frame; ValueError when it is damaged."""
    got = _read_frame(io.BytesIO(frame), "")
    if got is None:
        raise ValueError("empty frame")
    return got


def logged_frames(wal_dir: str, after: int) -> Iterator[tuple[int, bytes]]:
    """(lsn, frame bytes) of the log's intact records after ``after``, read from its
    segments as they are on disk (the log is being written meanwhile: reading stops
    quietly at the first frame not (yet) whole; ``void`` frames are skipped, as the
    refused lsns they declare). Records missing after ``after`` (segments pruned
    since the snapshot was chosen) end the stream: the standby starts again from a
    newer snapshot instead of missing them."""
    expected = after + 1
    for _first, path in segment_paths(wal_dir):
        with open(path, "rb") as f:
            head = f.read(SEGMENT_HEADER.size)
            if len(head) < SEGMENT_HEADER.size:
                return
            if SEGMENT_HEADER.unpack(head)[0] != SEGMENT_MAGIC:
                raise ValueError(f"{path}: not a write-ahead log segment")
            while True:
                raw = f.read(FRAME.size)
                if len(raw) < FRAME.size:
                    break
                magic, hlen, blen, crc = FRAME.unpack(raw)
                if magic != MAGIC or hlen > MAX_HEADER:
                    return
                rest = f.read(hlen + blen)
                if len(rest) < hlen + blen or zlib.crc32(rest) != crc:
                    return
                header = json.loads(rest[:hlen])
                if header.get("op") == "void":  # as the log's reader skips them
                    if int(header["first"]) <= expected:
                        expected = max(expected, int(header["last"]) + 1)
                    continue
                lsn = int(header["lsn"])
                if lsn <= after:
                    continue
                if lsn != expected:
                    raise Unavailable(
                        f"records {expected} to {lsn - 1} are no longer in the log "
                        f"{wal_dir} (pruned after a snapshot): follow again, from the "
                        "newest snapshot",
                        reason="NOT_REPLICATED",
                    )
                expected = lsn + 1
                yield lsn, raw + rest
