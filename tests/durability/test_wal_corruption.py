"""A torn tail of the write-ahead log against corruption in its middle (issue 11, 13).

The log is written by real servers; the damage is made by hand between starts. A torn
tail is what a crash mid-write leaves and is dropped with a warning; a bad frame with
intact records after it, or in a segment that is not the last, is corruption: the
server refuses to start (``onnxps serve`` exits 2 with one line) unless started with
``--wal-truncate-corrupt``, which cuts the log there and says what it dropped.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _procs import StartServer, clean_env, stop
from onnxps.client import Adam, Client
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.server.durability._wal import MAGIC, SEGMENT_HEADER, WalCorruptError


def _config(data: Path, truncate: bool = False) -> ServerConfig:
    return ServerConfig(
        address="127.0.0.1:0",
        durability="wal",
        data_dir=str(data),
        snapshot_interval=0,
        wal_truncate_corrupt=truncate,
    )


def _crash(handle: ServerHandle) -> None:
    """Stop without the shutdown snapshot: the log holds every change."""
    handle.server.stop(0).wait()
    d = handle.durability
    assert d is not None and d.journal is not None
    d.journal.close()
    handle.store.close()
    d._unlock()
    handle._stopped.set()


def _write_log(
    servers: Callable[[ServerConfig], ServerHandle], data: Path, pushes: int
) -> list[np.ndarray]:
    """A group and ``pushes`` pushes, one segment; the state after each push."""
    handle = servers(_config(data))
    states = []
    with Client(handle.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(64)})
        states.append(c.pull("g")[0])
        for k in range(pushes):
            c.push("g", np.full(64, k + 1.0))
            states.append(c.pull("g")[0])
    _crash(handle)
    return states


def _frames(segment: Path) -> list[int]:
    """Byte offsets of the frames of a segment."""
    data = segment.read_bytes()
    offsets, pos = [], SEGMENT_HEADER.size
    while pos < len(data):
        offsets.append(pos)
        hlen = int.from_bytes(data[pos + 4 : pos + 8], "little")
        blen = int.from_bytes(data[pos + 8 : pos + 16], "little")
        pos += 20 + hlen + blen
    assert all(data[o : o + 4] == MAGIC for o in offsets)
    return offsets


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _segment(data: Path) -> Path:
    (segment,) = sorted((data / "wal").glob("wal-*.log"))
    return segment


def _serve(data: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``onnxps serve`` on a data dir it must refuse: it exits by itself."""
    return subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "127.0.0.1:0"]
        + ["--durability", "wal", "--data-dir", str(data), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )


def test_one_bad_byte_in_the_middle_refuses_to_start_naming_segment_and_offset(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    data = tmp_path / "data"
    _write_log(servers, data, pushes=6)
    segment = _segment(data)
    frames = _frames(segment)  # create, then six pushes
    assert len(frames) == 7
    _flip(segment, frames[3] + 40)  # inside the third push's record
    with pytest.raises(WalCorruptError) as err:
        create_server(_config(data))
    assert str(err.value) == (
        f"corrupt write-ahead log: {segment}: checksum mismatch at byte {frames[3]}, "
        "in the middle of the log (not a write cut short by a crash); 3 intact "
        f"records and {segment.stat().st_size - frames[3]} bytes follow it. Restore "
        "the data directory from a backup, or start with --wal-truncate-corrupt to "
        "cut the log there and lose them"
    )
    run = _serve(data)
    assert run.returncode == 2
    said = [line for line in run.stderr.splitlines() if "ERROR" not in line]
    said = [line for line in said if " INFO " not in line]
    assert said == [f"onnxps: {err.value}"], run.stderr  # one line besides the log
    assert "Traceback" not in run.stderr
    assert len(_frames(segment)) == 7  # nothing was cut without being asked


def test_wal_truncate_corrupt_cuts_the_log_there_and_says_what_it_dropped(
    tmp_path: Path,
    servers: Callable[[ServerConfig], ServerHandle],
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = tmp_path / "data"
    states = _write_log(servers, data, pushes=6)
    segment = _segment(data)
    frames = _frames(segment)
    dropped = segment.stat().st_size - frames[3]
    _flip(segment, frames[3] + 40)
    with caplog.at_level(logging.ERROR, logger="onnxps.durability"):
        handle = servers(_config(data, truncate=True))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"corrupt write-ahead log: {segment}: checksum mismatch at byte {frames[3]}; "
        "truncated the log there (--wal-truncate-corrupt): dropped 3 intact records "
        f"and {dropped} bytes"
    ]
    assert segment.stat().st_size == frames[3]
    with Client(handle.address) as c:
        t, (x,) = c.pull_versioned("g")
        assert t == 2  # the two pushes before the damage
        assert x.tobytes() == states[2].tobytes()
        c.push("g", np.ones(64))
    _crash(handle)
    again = servers(_config(data))  # the cut log is healthy: no flag needed now
    with Client(again.address) as c:
        assert c.describe_group("g").update_count == 3


def test_the_flag_through_the_command_line(
    server_processes: StartServer,
    tmp_path: Path,
    servers: Callable[[ServerConfig], ServerHandle],
) -> None:
    data = tmp_path / "data"
    _write_log(servers, data, pushes=4)
    segment = _segment(data)
    _flip(segment, _frames(segment)[2] + 30)
    assert _serve(data).returncode == 2
    proc, address = server_processes(
        tmp_path / "serve.log",
        "--durability", "wal", "--data-dir", str(data), "--wal-truncate-corrupt",
    )  # fmt: skip
    with Client(address) as c:
        assert c.describe_group("g").update_count == 1
    stop(proc)
    log = (tmp_path / "serve.log").read_text()
    assert "ERROR onnxps.durability: corrupt write-ahead log" in log
    assert "dropped 2 intact records" in log


def test_damage_in_a_segment_that_is_not_the_last_is_corruption(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    data = tmp_path / "data"
    handle = servers(_config(data))
    with Client(handle.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(8)})
        c.push("g", np.ones(8))
        c.push("g", np.ones(8))
        handle.durability.journal.rotate()  # type: ignore[union-attr]
        c.push("g", np.ones(8))
    _crash(handle)
    first, second = sorted((data / "wal").glob("wal-*.log"))
    # the last frame of the first segment cut short, as a crash would leave it,
    # but the log went on in the next segment: that is not a torn tail
    last = _frames(first)[-1]
    with open(first, "r+b") as f:
        f.truncate(last + 25)
    with pytest.raises(WalCorruptError) as err:
        create_server(_config(data))
    message = str(err.value)
    assert f"{first}: truncated record at byte {last}" in message
    nbytes = 25 + second.stat().st_size
    assert (
        f"1 intact record and {nbytes} bytes (in this and 1 later segment) follow it"
        in message
    )


@pytest.mark.parametrize("how", ["half_frame", "bad_crc_last", "zeros"])
def test_a_torn_tail_is_dropped_with_a_warning_and_cut_off(
    tmp_path: Path,
    servers: Callable[[ServerConfig], ServerHandle],
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    data = tmp_path / "data"
    states = _write_log(servers, data, pushes=3)
    segment = _segment(data)
    frames = _frames(segment)
    size = segment.stat().st_size
    if how == "half_frame":  # a fourth push cut short
        tail = segment.read_bytes()[frames[-1] :]
        with open(segment, "ab") as f:
            f.write(tail[: len(tail) // 2])
        expect_t, cut, reason = 3, size, "truncated record"
    elif how == "bad_crc_last":  # the last frame written wholly, its data not
        _flip(segment, size - 3)
        expect_t, cut, reason = 2, frames[-1], "checksum mismatch"
    else:  # the file grew, its blocks never written
        with open(segment, "ab") as f:
            f.write(bytes(4096))
        expect_t, cut, reason = 3, size, "bad frame magic"
    with caplog.at_level(logging.INFO, logger="onnxps.durability"):
        handle = servers(_config(data))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"write-ahead log {segment}: {reason}")
    assert f"at byte {cut}, the end of the last segment" in warnings[0]
    assert segment.stat().st_size == cut  # cut off before the log goes on
    with Client(handle.address) as c:
        t, (x,) = c.pull_versioned("g")
        assert t == expect_t
        assert x.tobytes() == states[expect_t].tobytes()
        c.push("g", np.ones(64))
    _crash(handle)
    again = servers(_config(data))
    with Client(again.address) as c:
        assert c.describe_group("g").update_count == expect_t + 1


def test_the_logs_crc_is_zlib_ngs_and_equals_zlibs() -> None:
    """A frame's CRC-32 is zlib-ng's when installed (the ``fast`` and
    ``replication`` extras; about 9 times faster), the value zlib gives."""
    import zlib

    import zlib_ng.zlib_ng
    from onnxps.server.durability import _walread
    from onnxps.server.durability._wal import Frame

    assert _walread.crc32 is zlib_ng.zlib_ng.crc32
    a = np.random.default_rng(7).random(1 << 16).astype(np.float32)
    body = a.data.cast("B")
    frame = Frame(b'{"op": "push"}', [a])
    prefix = frame.chunks()[0]
    assert prefix[-4:] == zlib.crc32(body, zlib.crc32(b'{"op": "push"}')).to_bytes(
        4, "little"
    )
    assert _walread.crc32(body[5:], 3) == zlib.crc32(body[5:], 3)
