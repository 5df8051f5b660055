"""The write-ahead log under a hostile filesystem and odd histories (issue 27,
items 11-13), with real server processes and real data directories."""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import clean_env, start_server, stop
from _servers import _fill, _tmpfs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.client import (
    Adam,
    Client,
    FailedPreconditionError,
    ResourceExhaustedError,
)
from onnxps.server.durability._snapshot import list_snapshots, load_snapshot
from onnxps.server.durability._wal import WriteAheadLog, read_segments, segment_paths

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


@pytest.mark.slow
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


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    return int(reply.status)


def _alarms(log: Path) -> dict[str, float]:
    """``onnxps_durability_alarm`` by reason, scraped from the server's metrics."""
    found = re.search(r"metrics on (http://\S+/metrics)", log.read_text())
    assert found, log.read_text()
    with urllib.request.urlopen(found.group(1), timeout=10) as page:
        text = page.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'onnxps_durability_alarm\{reason="(\w+)"\} (\S+)', text)
    }


REASONS = ("DISK_FULL", "WAL_UNLINKED", "WAL_WRITE_FAILED", "SNAPSHOT_FAILED")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_log_no_longer_on_disk_refuses_every_change_at_once(
    tmp_path: Path, how: str
) -> None:
    data, log = tmp_path / "data", tmp_path / "server.log"
    moved = tmp_path / "moved"
    x = np.zeros(64, F32)
    with _server(log, data, "--metrics-port", "0") as address:
        with Client(address, timeout=60, client_id="w") as c:
            c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": x})
            for k in range(3):
                c.push("g", np.full(64, k + 1, F32))
            t, before = c.pull_versioned("g", state=True)
            assert _alarms(log)["WAL_UNLINKED"] == 0
            if how == "removed":
                shutil.rmtree(data)  # rm -rf under the running server
                # noticed with no change in flight: health says so by itself
                for _ in range(200):  # bounded: the idle check runs every second
                    if _health(address) == NOT_SERVING:
                        break
                    threading.Event().wait(0.05)
                assert _health(address) == NOT_SERVING
            else:
                os.rename(data, moved)  # the next push finds it
            for _ in range(20):
                with pytest.raises(FailedPreconditionError) as err:
                    c.push("g", np.ones(64, F32))
                assert err.value.reason == "WAL_UNLINKED", err.value
                assert "no longer on disk" in err.value.details
                assert "onnxps export" in err.value.details
            with pytest.raises(FailedPreconditionError, match="not applied"):
                c.set_learning_rate("g", 0.5)
            with pytest.raises(FailedPreconditionError) as err:
                c.create_group("h", Adam(), learning_rate=0.1, tensors={"w": x})
            assert err.value.reason == "WAL_UNLINKED"
            # nothing was applied, and the state can still be read (to export it)
            t_now, now = c.pull_versioned("g", state=True)
            assert t_now == t == 3
            assert [a.tobytes() for a in now] == [a.tobytes() for a in before]
            assert [g.name for g in c.list_groups()] == ["g"]
            assert _health(address) == NOT_SERVING
            alarms = _alarms(log)
            assert alarms["WAL_UNLINKED"] == 1 and alarms["DISK_FULL"] == 0
            assert c.export(tmp_path / "saved.npz") == ["g"]  # what the error says
    assert "reason WAL_UNLINKED" in log.read_text()
    # ... restart on a data directory and import them
    with _server(tmp_path / "fresh.log", tmp_path / "fresh") as address:
        with Client(address, timeout=60) as c:
            c.import_(tmp_path / "saved.npz")
            t_imported, imported = c.pull_versioned("g", state=True)
            assert t_imported == 3
            assert [a.tobytes() for a in imported] == [a.tobytes() for a in before]
    if how == "moved":
        # what was acknowledged is in the moved directory, and nothing more
        with _server(tmp_path / "restart.log", moved) as address:
            with Client(address, timeout=60) as c:
                t_restored, restored = c.pull_versioned("g", state=True)
                assert t_restored == 3
                assert [a.tobytes() for a in restored] == [a.tobytes() for a in before]
                assert c.describe_group("g").learning_rate == pytest.approx(0.1)


def test_a_full_disk_refuses_pushes_at_once_and_resumes_when_space_returns(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    log = tmp_path / "server.log"
    n = 4096  # a push record is 16 KiB
    with _tmpfs(disk, "2m"):
        data = disk / "data"
        with _server(log, data, "--metrics-port", "0") as address:
            with Client(address, timeout=60, client_id="w") as c:
                c.create_group(
                    "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(n, F32)}
                )
                acked = 0
                for k in range(3):
                    assert c.push("g", np.full(n, k + 1, F32)) == acked + 1
                    acked += 1
                t, before = c.pull_versioned("g", state=True)
                filler = disk / "filler"
                assert _fill(filler) > 0
                for _ in range(5):
                    with pytest.raises(ResourceExhaustedError) as err:
                        c.push("g", np.ones(n, F32))
                    assert err.value.reason == "DISK_FULL", err.value
                    assert "is full" in err.value.details
                    assert "not applied" in err.value.details
                    assert err.value.metadata["errno"] == str(errno.ENOSPC)
                with pytest.raises(ResourceExhaustedError) as err:
                    c.create_group(
                        "h", Adam(), learning_rate=0.1, tensors={"w": np.zeros(n, F32)}
                    )
                assert err.value.reason == "DISK_FULL"
                assert [g.name for g in c.list_groups()] == ["g"]
                # refused, not retried until the deadline: the state is unchanged
                t_now, now = c.pull_versioned("g", state=True)
                assert t_now == t == acked
                assert [a.tobytes() for a in now] == [a.tobytes() for a in before]
                assert _health(address) == NOT_SERVING
                assert _alarms(log)["DISK_FULL"] == 1
                filler.unlink()  # room again: no restart
                for k in range(2):
                    assert c.push("g", np.full(n, 10 + k, F32)) == acked + 1
                    acked += 1
                assert _health(address) == SERVING
                assert _alarms(log) == dict.fromkeys(REASONS, 0.0)
                t, before = c.pull_versioned("g", state=True)
        text = log.read_text()
        assert "reason DISK_FULL" in text
        assert "is written again" in text
        # kill -9, restart: exactly the acknowledged pushes
        with _server(tmp_path / "restart.log", data) as address:
            with Client(address, timeout=60) as c:
                t_restored, restored = c.pull_versioned("g", state=True)
                assert t_restored == t == acked == 5
                assert [a.tobytes() for a in restored] == [a.tobytes() for a in before]
        assert "records are missing" not in (tmp_path / "restart.log").read_text()
