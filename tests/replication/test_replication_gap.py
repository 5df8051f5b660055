"""A primary that cannot read a record a standby needs from its log sends a snapshot
instead (issue 23): it never skips the record. Real etcd, real ``onnxps serve``
processes, a real log damaged on disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _replicas import SIZE, ReplicaSet, _create
from onnxps.client import Client
from onnxps.server.durability._wal import (
    FRAME,
    SEGMENT_HEADER,
    LogReader,
    WalGapError,
    WriteAheadLog,
    segment_paths,
)


def _records(wal_dir: Path, op: str = "push") -> list[tuple[int, str, int]]:
    """(lsn, segment, offset of the record's body) of every ``op`` record."""
    found = []
    for _, path in segment_paths(str(wal_dir)):
        data = Path(path).read_bytes()
        pos = SEGMENT_HEADER.size
        while pos + FRAME.size <= len(data):
            _magic, hlen, blen, _crc = FRAME.unpack_from(data, pos)
            header = json.loads(data[pos + FRAME.size : pos + FRAME.size + hlen])
            body = pos + FRAME.size + hlen
            if header.get("op") == op:
                found.append((int(header["lsn"]), path, body))
            pos = body + blen
    return found


@pytest.mark.slow
def test_a_record_the_primary_cannot_read_back_is_sent_in_a_snapshot_not_skipped(
    replicas: Any,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(3)
    p = rs.primary()
    s = int(rs.wait_sync()[0][1:])
    o = 3 - p - s  # the standby that is not synchronous
    _create(rs.url)
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        for _ in range(3):
            c.push("g", g)
        rs.wait_t(o, "g", 3)
        rs.procs[o].kill()
        rs.procs[o].wait()
        for _ in range(10):  # acknowledged by s; o lacks them
            c.push("g", g)
    # One of the records o lacks, durable long ago and no longer kept in the
    # primary's memory, is damaged on its disk (bit rot): its CRC fails.
    lsn, path, body = _records(tmp_path / f"data{p}" / "wal")[-5]
    with open(path, "r+b") as f:
        f.seek(body)
        byte = f.read(1)
        f.seek(body)
        f.write(bytes([byte[0] ^ 0xFF]))
    rs.start(o)  # resumes after its last record: the primary reads its log
    rs.wait_t(o, "g", 13, timeout=60)
    t, x = rs.state(p, "g")
    assert t == 13
    np.testing.assert_array_equal(rs.state(o, "g")[1], x)
    log = (tmp_path / f"server{p}-1.log").read_text()
    assert f"record {lsn}" in log and "sending a snapshot" in log


def _log_of(wal_dir: Path, count: int, rotate_after: int) -> None:
    """A log of ``count`` records, a new segment after record ``rotate_after``."""
    wal = WriteAheadLog(str(wal_dir), 1)
    try:
        for k in range(1, count + 1):
            wal.wait(wal.log({"op": "set_lr", "group": "g", "lr": k}, []))
            if k == rotate_after:
                wal.rotate()
    finally:
        wal.close()


def _lsns(wal_dir: Path, after: int, upto: int) -> list[int]:
    return [int(h["lsn"]) for h, _ in LogReader(str(wal_dir), after).frames(upto)]


def test_the_log_gives_back_the_records_of_a_range_as_it_holds_them(
    tmp_path: Path,
) -> None:
    _log_of(tmp_path, 6, rotate_after=3)
    assert _lsns(tmp_path, 2, 5) == [3, 4, 5]
    on_disk = b"".join(Path(p).read_bytes() for _, p in segment_paths(str(tmp_path)))
    for header, chunks in LogReader(str(tmp_path), 0).frames(6):
        assert header["lr"] == header["lsn"]
        assert b"".join(chunks) in on_disk


@pytest.mark.parametrize("how", ["pruned", "damaged", "torn", "not written"])
def test_a_record_the_log_cannot_give_back_raises_it_is_never_skipped(
    tmp_path: Path, how: str
) -> None:
    _log_of(tmp_path, 6, rotate_after=3)
    lsn, path, body = {r[0]: r for r in _records(tmp_path, "set_lr")}[
        {"pruned": 2, "damaged": 5, "torn": 6, "not written": 6}[how]
    ]
    upto = 6
    if how == "pruned":  # as after a snapshot that covers records 1 to 3
        os.unlink(path)
    elif how == "damaged":  # a bit of record 5's header flipped: its CRC fails
        with open(path, "r+b") as f:
            f.seek(body - 2)
            byte = f.read(1)
            f.seek(body - 2)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "torn":  # record 6 cut short
        os.truncate(path, os.path.getsize(path) - 1)
    else:
        lsn = upto = 7
    with pytest.raises(WalGapError, match=f"records? {lsn} "):
        _lsns(tmp_path, 1, upto)
    assert _lsns(tmp_path, lsn, lsn) == []  # nothing was asked
