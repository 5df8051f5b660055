"""A log record as a WAL frame (docs/FORMAT.md), to ship and to read back."""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._wal import FRAME, MAGIC, _read_frame, c_order

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
