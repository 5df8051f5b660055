"""The write-ahead log under a hostile filesystem and odd histories (issue 27,
items 11-13), with real server processes and real data directories."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from _procs import clean_env, start_server, stop
from onnxps.client import Adam, Client
from onnxps.server._snapshot import list_snapshots, load_snapshot
from onnxps.server._wal import WriteAheadLog, read_segments, segment_paths

F32 = np.float32


@contextmanager
def _server(log: Path, data: Path, *args: str) -> Iterator[str]:
    proc, address = start_server(
        log,
        "--durability",
        "wal",
        "--data-dir",
        str(data),
        "--snapshot-interval",
        "0",
        *args,
        env=clean_env(),
    )
    try:
        yield address
    finally:
        stop(proc)  # kill -9: what the log holds is what survives


def _warnings(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if "not replayed" in ln]


def _snapshot_while_deleting(address: str, data: Path) -> bool:
    """Save a snapshot and, between its log rotation and its capture of group "z",
    push to "z" and delete it: the snapshot then holds neither "z" nor its last
    records, which the log holds after the snapshot's lsn. True when it happened
    so (the big group "a" is written first, which gives the time)."""
    wal = data / "wal"
    before = {p for _, p in segment_paths(str(wal))}
    with Client(address, timeout=60, client_id="w") as c:
        saved = threading.Thread(target=c.save)
        saved.start()
        for _ in range(20_000):  # the rotation opens a new segment: wait for it
            if {p for _, p in segment_paths(str(wal))} - before:
                break
            threading.Event().wait(0.001)
        c.push("z", np.ones(4, F32))
        c.delete_group("z")
        saved.join(60)
    newest = list_snapshots(str(data / "snapshots"))[0][1]
    _, groups = load_snapshot(newest)
    return [g.image.name for g in groups] == ["a"]


def test_records_of_a_group_deleted_later_in_the_log_replay_without_warning(
    tmp_path: Path,
) -> None:
    data, log = tmp_path / "data", tmp_path / "server.log"
    raced = False
    for attempt in range(5):  # bounded: the race is won in the first try or so
        with _server(log, data) as address:
            with Client(address, timeout=60, client_id="w") as c:
                if attempt == 0:
                    big = np.zeros(48 << 20 >> 2, F32)  # 48 MiB: written first
                    c.create_group("a", Adam(), learning_rate=0.1, tensors={"w": big})
                    c.push("a", np.ones_like(big))
                c.create_group(
                    "z", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4, F32)}
                )
                c.push("z", np.ones(4, F32))
            raced = _snapshot_while_deleting(address, data)
            if raced:
                with Client(address, timeout=60, client_id="w") as c:
                    c.push("a", np.ones(48 << 20 >> 2, F32))  # after the snapshot
                    t, expected = c.pull_versioned("a", state=True)
        if raced:
            break
    assert raced, "the delete never fell between the snapshot's rotation and capture"
    wal_lsn = load_snapshot(list_snapshots(str(data / "snapshots"))[0][1])[0].wal_lsn
    after = [
        (h["op"], h["group"]) for h, _ in read_segments(str(data / "wal"), wal_lsn)
    ]
    assert ("push", "z") in after and ("delete", "z") in after  # z's records replay
    restart = tmp_path / "restart.log"
    with _server(restart, data) as address, Client(address, timeout=60) as c:
        assert [g.name for g in c.list_groups()] == ["a"]
        t2, values = c.pull_versioned("a", state=True)
        assert t2 == t == 2
        assert [v.tobytes() for v in values] == [v.tobytes() for v in expected]
    assert _warnings(restart) == []
    assert "Traceback" not in restart.read_text()


def test_a_record_on_a_group_nothing_creates_still_warns(tmp_path: Path) -> None:
    data, log = tmp_path / "data", tmp_path / "server.log"
    with _server(log, data) as address, Client(address, timeout=30) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4, F32)})
        c.push("g", np.ones(4, F32))
    wal = str(data / "wal")
    records = list(read_segments(wal, 0))
    header, arrays = next((h, a) for h, a in records if h["op"] == "push")
    # The log goes on with a push on a group no record creates (written by the
    # server's own log writer, as a damaged history would leave it).
    journal = WriteAheadLog(wal, int(records[-1][0]["lsn"]) + 1)
    record = {k: v for k, v in header.items() if k not in ("lsn", "arrays")}
    journal.wait(journal.log({**record, "group": "ghost", "t": 0}, arrays))
    journal.close()
    restart = tmp_path / "restart.log"
    with _server(restart, data) as address, Client(address, timeout=30) as c:
        assert [g.name for g in c.list_groups()] == ["g"]
        assert c.describe_group("g").update_count == 1
    warned = _warnings(restart)
    assert len(warned) == 1, warned
    assert "WARNING" in warned[0]
    assert "(push on 'ghost') not replayed: no group named 'ghost'" in warned[0]
