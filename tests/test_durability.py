"""Snapshots, restore, the write-ahead log and export/import, with in-process servers.

A "crash" here stops the gRPC server and closes the log without the shutdown snapshot
(what kill -9 leaves behind once the fsynced records are on disk); the real kill -9
runs are in test_crash_recovery.py.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxps import cli
from onnxps.client import Adagrad, Adam, Client, Momentum, Sync
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.server.durability._wal import WAL_FORMAT_VERSION, WalFormatError
from onnxps.wire.image import GroupDefinition, GroupImage, ImageFormatError

F32 = np.float32


def _config(data_dir: Path | None, mode: str = "snapshot") -> ServerConfig:
    return ServerConfig(
        address="127.0.0.1:0",
        durability=mode,
        data_dir=str(data_dir) if data_dir else None,
        snapshot_interval=0,
        keep_snapshots=3,
    )


@pytest.fixture
def servers() -> Iterator[Callable[[ServerConfig], ServerHandle]]:
    started: list[ServerHandle] = []

    def start(config: ServerConfig) -> ServerHandle:
        handle = create_server(config).start()
        started.append(handle)
        return handle

    yield start
    for h in started:
        h.stop(grace=0)


def _crash(handle: ServerHandle) -> None:
    """Stop serving without the shutdown snapshot; the log keeps what was fsynced."""
    handle.server.stop(0).wait()
    d = handle.durability
    assert d is not None
    if d.journal is not None:
        d.journal.close()
    handle.store.close()
    os.close(d._lock_fd)
    d._lock_fd = -1
    handle._stopped.set()


def _grad(k: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(1000 + k)
    return rng.standard_normal(shape).astype(dtype)


def _assert_same_state(a: Client, b: Client, group: str) -> None:
    ta, va = a.pull_versioned(group, state=True)
    tb, vb = b.pull_versioned(group, state=True)
    assert ta == tb
    assert len(va) == len(vb)
    for x, y in zip(va, vb, strict=True):
        assert x.dtype == y.dtype
        assert x.tobytes() == y.tobytes()
    assert (
        a.describe_group(group).learning_rate == b.describe_group(group).learning_rate
    )


def _create_all(c: Client) -> None:
    c.create_group(
        "adam",
        Adam(norm_coefficient=0.01),
        learning_rate=0.05,
        tensors={"w": np.linspace(-1, 1, 12).reshape(3, 4), "b": np.zeros(4)},
    )
    c.create_group(
        "mom",
        Momentum(0.9, 1.0, "nesterov", 0.0),
        learning_rate=0.1,
        tensors={"w": np.arange(6, dtype=F32)},
    )
    c.create_group(
        "sync",
        Adagrad(decay_factor=0.1),
        learning_rate=0.2,
        tensors={"w": np.ones(5, dtype=F32)},
        consistency=Sync(2),
    )


def _phase1(c: Client, w1: Client, w2: Client) -> None:
    for k in range(5):
        c.push("adam", _grad(k, (3, 4), np.float64), _grad(k + 50, (4,), np.float64))
        c.push("mom", _grad(k, (6,), F32))
    c.set_learning_rate("mom", 0.25)
    for k in range(2):
        w1.push("sync", _grad(k, (5,), F32), base_version=k)
        w2.push("sync", _grad(k + 9, (5,), F32), base_version=k)
    w1.push("sync", _grad(7, (5,), F32), base_version=2)  # left pending


def _phase2(c: Client, w2: Client) -> None:
    w2.push("sync", _grad(8, (5,), F32), base_version=2)
    for k in range(5, 9):
        c.push("adam", _grad(k, (3, 4), np.float64), _grad(k + 50, (4,), np.float64))
        c.push("mom", _grad(k, (6,), F32))


def _clients(address: str) -> tuple[Client, Client, Client]:
    return (
        Client(address, client_id="driver"),
        Client(address, client_id="w1"),
        Client(address, client_id="w2"),
    )


@pytest.mark.parametrize("mode", ["snapshot", "wal"])
def test_restart_and_continue_is_bit_identical(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle], mode: str
) -> None:
    ref = servers(_config(None, "none"))
    first = servers(_config(tmp_path, mode))
    rc, r1, r2 = _clients(ref.address)
    c, w1, w2 = _clients(first.address)
    try:
        for cl in (rc, c):
            _create_all(cl)
        _phase1(rc, r1, r2)
        _phase1(c, w1, w2)
        assert c.describe_group("sync").pending_contributions == 1
        first.stop(grace=1)  # graceful: snapshot on shutdown
        second = servers(_config(tmp_path, mode))
        c2, w1b, w2b = _clients(second.address)
        with c2, w1b, w2b:
            info = c2.describe_group("sync")
            assert (info.update_count, info.pending_contributions) == (2, 1)
            assert c2.describe_group("mom").learning_rate == 0.25
            _phase2(rc, r2)
            _phase2(c2, w2b)
            for g in ("adam", "mom", "sync"):
                _assert_same_state(rc, c2, g)
            assert c2.describe_group("adam").update_count == 9
    finally:
        for cl in (rc, r1, r2, c, w1, w2):
            cl.close()


def test_dedup_table_survives_restart(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    first = servers(_config(tmp_path))
    with Client(first.address, client_id="retrier") as c:
        c._seq = itertools.count(500)
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3)})
        assert c.push_detailed("g", np.ones(3)).update_count == 1  # seq 500
    first.stop(grace=1)
    second = servers(_config(tmp_path))
    with Client(second.address, client_id="retrier") as c:
        c._seq = itertools.count(500)  # the retry of seq 500 after a lost reply
        again = c.push_detailed("g", np.ones(3))
        assert (again.update_count, again.applied, again.duplicate) == (1, True, True)
        assert c.describe_group("g").update_count == 1
        fresh = c.push_detailed("g", np.ones(3))  # seq 501
        assert (fresh.update_count, fresh.duplicate) == (2, False)


def _snapshot_dirs(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "snapshots").glob("snap-*"))


def _damage(snap: Path, how: str) -> str:
    if how == "manifest_version":
        m = json.loads((snap / "manifest.json").read_text())
        m["format_version"] = 99
        (snap / "manifest.json").write_text(json.dumps(m))
        return "format_version 99"
    if how == "manifest_truncated":
        text = (snap / "manifest.json").read_bytes()
        (snap / "manifest.json").write_bytes(text[: len(text) // 2])
        return "unreadable manifest"
    if how in MANIFEST_EDITS:
        return _edit_manifest(snap, how)
    target = snap / "g00000-a0.npy"
    data = bytearray(target.read_bytes())
    if how == "truncated":
        target.write_bytes(bytes(data[: len(data) - 8]))
        return "g00000-a0.npy"
    data[-3] ^= 0xFF
    target.write_bytes(bytes(data))
    return "sha256 does not match"


MANIFEST_EDITS = {
    # how: the reason the log line gives
    "update_count": "manifest_sha256 does not match the manifest",
    "wal_lsn": "manifest_sha256 does not match the manifest",
    "renamed_key": "manifest_sha256 does not match the manifest",
    "no_checksum": "has no manifest_sha256",
    # re-hashed after the edit, as a tool that rewrote the manifest would
    "missing_field_rehashed": "malformed manifest: KeyError('wal_lsn')",
    "wrong_type_rehashed": "malformed manifest: TypeError",
    "missing_group_field_rehashed": "malformed group entry: KeyError('dedup')",
}


def _edit_manifest(snap: Path, how: str) -> str:
    path = snap / "manifest.json"
    m = json.loads(path.read_text())
    if how == "update_count":
        m["groups"][0]["image"]["update_count"] = 80
    elif how == "wal_lsn":
        m["wal_lsn"] += 1000
    elif how == "renamed_key":
        m["wal_seq"] = m.pop("wal_lsn")
    elif how == "no_checksum":
        del m["manifest_sha256"]
    elif how == "missing_field_rehashed":
        del m["wal_lsn"]
    elif how == "wrong_type_rehashed":
        m["generation"] = "2"
    elif how == "missing_group_field_rehashed":
        del m["groups"][0]["dedup"]
    if how.endswith("_rehashed"):
        del m["manifest_sha256"]
        canonical = json.dumps(m, sort_keys=True, separators=(",", ":"))
        m["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    path.write_text(json.dumps(m, indent=1))
    return MANIFEST_EDITS[how]


@pytest.mark.parametrize(
    "how",
    ["truncated", "flipped", "manifest_version", "manifest_truncated"]
    + list(MANIFEST_EDITS),
)
def test_damaged_newest_snapshot_falls_back_to_previous(
    tmp_path: Path,
    servers: Callable[[ServerConfig], ServerHandle],
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    first = servers(_config(tmp_path))
    with Client(first.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4)})
        for k in range(3):
            c.push("g", _grad(k, (4,), np.float64))
        saved = c.pull("g", state=True)
        c.save()
        c.push("g", _grad(3, (4,), np.float64))
        c.save()
    first.stop(grace=1)
    snaps = _snapshot_dirs(tmp_path)
    assert [p.name for p in snaps] == ["snap-000000000001", "snap-000000000002"]
    why = _damage(snaps[-1], how)
    with caplog.at_level(logging.WARNING, logger="onnxps.durability"):
        second = servers(_config(tmp_path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(snaps[-1]) in m and why in m for m in warnings), warnings
    with Client(second.address) as c:
        t, values = c.pull_versioned("g", state=True)
        assert t == 3
        for a, b in zip(values, saved, strict=True):
            assert a.tobytes() == b.tobytes()


def test_a_version_2_snapshot_without_a_manifest_checksum_still_restores(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    first = servers(_config(tmp_path))
    with Client(first.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4)})
        c.push("g", np.ones(4))
        saved = c.pull("g", state=True)
    first.stop(grace=1)
    (snap,) = _snapshot_dirs(tmp_path)
    m = json.loads((snap / "manifest.json").read_text())
    assert m["format_version"] == 3
    m["format_version"] = 2  # as the release before manifest checksums wrote it
    del m["manifest_sha256"]
    (snap / "manifest.json").write_text(json.dumps(m))
    second = servers(_config(tmp_path))
    with Client(second.address) as c:
        t, values = c.pull_versioned("g", state=True)
        assert t == 1
        assert [a.tobytes() for a in values] == [a.tobytes() for a in saved]


def test_wal_replays_everything_after_the_snapshot(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    ref = servers(_config(None, "none"))
    first = servers(_config(tmp_path, "wal"))
    rc, r1, r2 = _clients(ref.address)
    c, w1, w2 = _clients(first.address)
    try:
        for cl, a, b in ((rc, r1, r2), (c, w1, w2)):
            _create_all(cl)
            _phase1(cl, a, b)
        c.save()
        for cl, b in ((rc, r2), (c, w2)):
            _phase2(cl, b)  # completes the pending sync step
            cl.create_group(
                "late", Adam(), learning_rate=0.3, tensors={"w": np.full(3, 2.0)}
            )
            cl.push("late", np.ones(3))
            cl.set_learning_rate("late", 0.01)
            cl.push("late", np.ones(3))
            cl.delete_group("mom")
        _crash(first)
        second = servers(_config(tmp_path, "wal"))
        with Client(second.address) as c2:
            assert sorted(g.name for g in c2.list_groups()) == ["adam", "late", "sync"]
            for g in ("adam", "sync", "late"):
                _assert_same_state(rc, c2, g)
            assert c2.describe_group("late").update_count == 2
    finally:
        for cl in (rc, r1, r2, c, w1, w2):
            cl.close()


def test_torn_last_wal_record_is_ignored(
    tmp_path: Path,
    servers: Callable[[ServerConfig], ServerHandle],
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = servers(_config(tmp_path, "wal"))
    with Client(first.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(64)})
        for k in range(4):
            c.push("g", _grad(k, (64,), np.float64))
        before = c.pull("g", state=True)
    _crash(first)
    segment = sorted((tmp_path / "wal").glob("wal-*.log"))[-1]
    data = segment.read_bytes()
    # a fifth push whose write was cut short: the frame of the fourth, half written
    last = data.rindex(b"OPSW")
    with open(segment, "ab") as f:
        f.write(data[last : last + (len(data) - last) // 2])
    with caplog.at_level(logging.WARNING, logger="onnxps.durability"):
        second = servers(_config(tmp_path, "wal"))
    assert any(
        str(segment) in r.getMessage() and "truncated record" in r.getMessage()
        for r in caplog.records
    )
    with Client(second.address) as c:
        t, values = c.pull_versioned("g", state=True)
        assert t == 4
        for a, b in zip(values, before, strict=True):
            assert a.tobytes() == b.tobytes()
        c.push("g", _grad(4, (64,), np.float64))  # the log goes on after the tear
    _crash(second)
    third = servers(_config(tmp_path, "wal"))
    with Client(third.address) as c:
        assert c.describe_group("g").update_count == 5


def test_a_wal_segment_of_another_format_version_is_refused(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    first = servers(_config(tmp_path, "wal"))
    with Client(first.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4)})
        c.push("g", np.ones(4))
    _crash(first)
    segment = sorted((tmp_path / "wal").glob("wal-*.log"))[-1]
    data = bytearray(segment.read_bytes())
    assert data[:8] == b"ONNXPSWL"
    assert int.from_bytes(data[8:12], "little") == WAL_FORMAT_VERSION
    data[8:12] = (99).to_bytes(4, "little")
    segment.write_bytes(bytes(data))
    with pytest.raises(WalFormatError) as err:
        create_server(_config(tmp_path, "wal"))
    assert str(err.value) == (
        f"{segment}: write-ahead log format version 99, this server reads version "
        f"{WAL_FORMAT_VERSION}; use the onnxps release that wrote it"
    )


def test_a_group_image_of_another_format_version_is_refused() -> None:
    definition = GroupDefinition(
        name="g",
        optimizer="Adam",
        attributes={},
        learning_rate=0.1,
        update_count=3,
        dtype=np.dtype(np.float32),
        names=("w",),
        shapes=((2,),),
    )
    doc = definition.to_json()
    assert GroupDefinition.from_json(doc) == definition
    arrays = [np.zeros(2, F32)] * 3
    assert GroupImage.from_json(doc, arrays).definition == definition
    with pytest.raises(ImageFormatError, match="needs 3 arrays, got 1"):
        GroupImage(definition, arrays[:1])
    doc["format_version"] = 7
    with pytest.raises(ImageFormatError) as err:
        GroupImage.from_json(doc, arrays, "x.npz")
    assert str(err.value) == (
        "x.npz: group image format_version 7; this onnxps reads version 1"
    )


def test_unusable_data_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "regular-file"
    blocker.write_text("not a directory")
    bad = blocker / "data"
    with pytest.raises(OSError) as err:
        create_server(_config(bad))
    message = str(err.value)
    assert str(bad) in message
    assert "--data-dir" in message


def test_second_server_on_the_same_data_dir_is_refused(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    servers(_config(tmp_path))
    with pytest.raises(OSError, match="in use by another onnxps server"):
        create_server(_config(tmp_path))


def test_only_the_last_k_snapshots_are_kept(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    handle = servers(_config(tmp_path, "wal"))
    with Client(handle.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4)})
        for k in range(5):
            c.push("g", np.ones(4))
            reply = c.save()
            assert reply.groups == 1
            assert reply.path.endswith(f"snap-{k + 1:012d}")
    assert [p.name for p in _snapshot_dirs(tmp_path)] == [
        "snap-000000000003",
        "snap-000000000004",
        "snap-000000000005",
    ]
    # segments older than the oldest kept snapshot are gone
    segments = sorted((tmp_path / "wal").glob("wal-*.log"))
    manifest = json.loads((_snapshot_dirs(tmp_path)[0] / "manifest.json").read_text())
    assert int(segments[0].name[4:-4]) <= manifest["wal_lsn"] + 1
    assert len(segments) <= 4


def _fill(c: Client) -> None:
    c.create_group(
        "team/adam",
        Adam(alpha=0.8, norm_coefficient_post=0.001),
        learning_rate=0.05,
        tensors={
            "w": np.linspace(0, 1, 20, dtype=F32).reshape(4, 5),
            "b": np.ones(5, F32),
        },
        lease_seconds=7.0,
    )
    c.create_group(
        "team/sync",
        Adagrad(epsilon=1e-7),
        learning_rate=0.3,
        tensors={"w": np.arange(8.0)},
        consistency=Sync(3, "sum"),
    )
    c.create_group(
        "other", Momentum(0.5, 0.5), learning_rate=1.0, tensors={"w": np.ones(2)}
    )
    for k in range(6):
        c.push("team/adam", _grad(k, (4, 5), F32), _grad(k + 1, (5,), F32))
    c.set_learning_rate("team/adam", 0.02)


def test_export_import_round_trip_is_bit_exact(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    src, dst = servers(_config(None, "none")), servers(_config(None, "none"))
    path = tmp_path / "groups.npz"
    with Client(src.address) as a, Client(dst.address) as b:
        _fill(a)
        assert a.export(path, prefix="team/") == ["team/adam", "team/sync"]
        assert b.import_(path) == ["team/adam", "team/sync"]
        assert [g.name for g in b.list_groups()] == ["team/adam", "team/sync"]
        for g in ("team/adam", "team/sync"):
            _assert_same_state(a, b, g)
            ia, ib = a.describe_group(g), b.describe_group(g)
            assert (ia.optimizer, ia.consistency, ia.tensors, ia.lease_seconds) == (
                ib.optimizer,
                ib.consistency,
                ib.tensors,
                ib.lease_seconds,
            )
        assert b.describe_group("team/adam").update_count == 6
        # both go on identically
        for cl in (a, b):
            cl.push("team/adam", _grad(9, (4, 5), F32), _grad(10, (5,), F32))
        _assert_same_state(a, b, "team/adam")
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["metadata"].tobytes())
        assert meta["format_version"] == 2
        assert [g["format_version"] for g in meta["groups"]] == [1, 1]  # GroupImage
        assert [g["name"] for g in meta["groups"]] == ["team/adam", "team/sync"]
        assert sorted(z.files) == ["g0/0", "g0/1", "g0/2", "g0/3", "g0/4", "g0/5"] + [
            "g1/0",
            "g1/1",
            "metadata",
        ]


def test_export_import_commands(
    tmp_path: Path,
    servers: Callable[[ServerConfig], ServerHandle],
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, dst = servers(_config(None, "none")), servers(_config(None, "none"))
    path = str(tmp_path / "all.npz")
    with Client(src.address) as a:
        _fill(a)
    assert cli.main(["export", src.address, path]) == 0
    assert cli.main(["import", dst.address, path]) == 0
    out = capsys.readouterr().out
    assert f"exported 3 groups to {path}" in out
    assert f"imported 3 groups from {path}" in out
    with Client(src.address) as a, Client(dst.address) as b:
        for g in ("other", "team/adam", "team/sync"):
            _assert_same_state(a, b, g)


def _odd_shapes(c: Client) -> None:
    """Groups holding a 0-d tensor and an empty one beside an ordinary one."""
    c.create_group(
        "odd",
        Adam(),
        learning_rate=0.1,
        tensors={
            "s": np.array(1.5, F32),
            "e": np.zeros((0, 3), F32),
            "v": np.arange(3, dtype=F32),
        },
    )
    c.create_group(
        "odd-sync",
        Momentum(0.9, 1.0),
        learning_rate=0.1,
        tensors={"s": np.array(-2.0), "e": np.zeros(0)},
        consistency=Sync(2),
    )


def _odd_push(c: Client, k: int, client: Client | None = None) -> None:
    c.push("odd", np.array(0.5 + k, F32), np.zeros((0, 3), F32), _grad(k, (3,), F32))
    (client or c).push("odd-sync", np.array(0.25 * k), np.zeros(0), base_version=0)


ODD_SHAPES = [(), (0, 3), (3,)]


@pytest.mark.parametrize("restart", ["snapshot", "wal", "wal-crash"])
def test_zero_d_and_empty_tensors_keep_their_shape_across_a_restart(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle], restart: str
) -> None:
    mode = restart.removesuffix("-crash")
    ref = servers(_config(None, "none"))
    first = servers(_config(tmp_path, mode))
    with Client(ref.address, client_id="a") as r, Client(first.address) as c:
        for cl in (r, c):
            _odd_shapes(cl)
            cl.push("odd", np.array(0.5, F32), np.zeros((0, 3), F32), np.ones(3, F32))
            # one sync contribution of a 0-d gradient stays buffered
            cl.push("odd-sync", np.array(3.0), np.zeros(0), base_version=0)
        if restart == "wal-crash":
            _crash(first)
        else:
            first.stop(grace=1)
        second = servers(_config(tmp_path, mode))
        with Client(second.address, client_id="a") as c2:
            assert c2.describe_group("odd").tensors == list(
                zip("sev", ODD_SHAPES, strict=True)
            )
            assert [a.shape for a in c2.pull("odd", state=True)] == ODD_SHAPES * 3
            assert c2.describe_group("odd-sync").pending_contributions == 1
            # pushes go on, identically to the reference; b completes the sync step
            for cl, address in ((c2, second.address), (r, ref.address)):
                with Client(address, client_id="b") as b:
                    _odd_push(cl, 1, b)
                cl.push("odd", np.array(2, F32), np.zeros((0, 3), F32), np.ones(3, F32))
            for g in ("odd", "odd-sync"):
                _assert_same_state(r, c2, g)
            assert c2.describe_group("odd").update_count == 3
            assert c2.describe_group("odd-sync").update_count == 1


def test_zero_d_and_empty_tensors_survive_export_and_import(
    tmp_path: Path, servers: Callable[[ServerConfig], ServerHandle]
) -> None:
    src, dst = servers(_config(None, "none")), servers(_config(tmp_path, "wal"))
    path = tmp_path / "odd.npz"
    with Client(src.address) as a, Client(dst.address) as b:
        _odd_shapes(a)
        a.push("odd", np.array(0.5, F32), np.zeros((0, 3), F32), np.ones(3, F32))
        assert a.export(path, prefix="odd") == ["odd", "odd-sync"]
        assert b.import_(path) == ["odd", "odd-sync"]
        for g in ("odd", "odd-sync"):
            _assert_same_state(a, b, g)
        for cl in (a, b):
            cl.push("odd", np.array(2.0, F32), np.zeros((0, 3), F32), np.ones(3, F32))
        _assert_same_state(a, b, "odd")
    dst.stop(grace=1)  # and the imported group through a restart of a wal server
    again = servers(_config(tmp_path, "wal"))
    with Client(src.address) as a, Client(again.address) as b:
        _assert_same_state(a, b, "odd")
        assert [x.shape for x in b.pull("odd")] == ODD_SHAPES
