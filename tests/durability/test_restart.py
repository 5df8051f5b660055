"""A restart is short (issue 36 item 3): numba's kernels load beside the restore
and the replay (steps take the NumPy path, the same bits, until they are in) and
from numba's cache after the first start; replay opens only the log after the
newest snapshot; a standby stopped gracefully resumes after its snapshot instead of
taking its primary's whole snapshot. benchmarks/restart.py has the figures.
"""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import StartServer, clean_env
from _replicas import ReplicaSet
from _servers import _crash
from onnxps.client import Adagrad, Client
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.kernels import Stepper, _select, apply_onnx, make_attrs

F32 = np.float32


def _grads(n: int, size: int, dtype: Any = F32) -> list[np.ndarray]:
    rng = np.random.default_rng(36)
    return [rng.standard_normal(size).astype(dtype) for _ in range(n)]


def _reference(grads: list[np.ndarray], lr: float = 0.1) -> np.ndarray:
    """X after Adagrad steps T = 0, 1, ... from zeros (the NumPy reference)."""
    x = np.zeros_like(grads[0])
    h = np.zeros_like(x)
    for t, g in enumerate(grads):
        x, h = apply_onnx("Adagrad", {}, [lr, t, x, g, h], kernels="numpy")
    return x


def test_a_stepper_steps_with_numpy_while_the_kernels_load_then_takes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(_select.ENV, raising=False)
    if _select.fused_kernels() is None:
        pytest.skip("numba is not installed")
    # as while load_in_background's thread runs
    monkeypatch.setattr(_select, "_loaded", False)
    monkeypatch.setattr(_select, "_loading", object())
    grads = _grads(4, 100_003)
    x, h = np.zeros(100_003, F32), np.zeros(100_003, F32)
    stepper = Stepper(make_attrs("Adagrad", {}), F32, [x.size])
    assert stepper.kernels == "numpy"
    for t, g in enumerate(grads[:2]):
        stepper.step(0.1, t, [x], [g], None, [h])
        assert stepper.kernels == "numpy"
    monkeypatch.setattr(_select, "_loaded", True)  # the load ended
    for t, g in enumerate(grads[2:], start=2):
        stepper.step(0.1, t, [x], [g], None, [h])
        assert stepper.kernels == "numba"
    np.testing.assert_array_equal(x, _reference(grads))
    assert x.tobytes() == _reference(grads).tobytes()


def test_replay_opens_only_the_log_after_the_newest_snapshot(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ServerConfig(
        address="127.0.0.1:0",
        durability="wal",
        data_dir=str(tmp_path),
        snapshot_interval=0,
    )
    grads = _grads(9, 1000)
    first = servers(config)
    try:
        with Client(first.address) as c:
            c.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"x": 0 * grads[0]}
            )
            for g in grads[:2]:
                c.push("g", g)
            c.save()  # after records 1-3 (the create, 2 pushes)
            for g in grads[2:5]:
                c.push("g", g)
            c.save()  # after record 6; the log after the oldest kept one stays
            for g in grads[5:]:
                c.push("g", g)
    finally:
        _crash(first)
    segments = sorted((tmp_path / "wal").glob("wal-*.log"))
    assert [int(p.stem.split("-")[1]) for p in segments] == [4, 7]
    # a flipped byte in a record before the snapshot: never read, so never noticed
    old = bytearray(segments[0].read_bytes())
    old[len(old) // 2] ^= 0xFF
    segments[0].write_bytes(bytes(old))
    caplog.set_level(logging.INFO, logger="onnxps.durability")
    second = servers(config)
    with Client(second.address) as c:
        assert c.describe_group("g").update_count == 9
        assert c.pull("g")[0].tobytes() == _reference(grads).tobytes()
    replayed = [r.getMessage() for r in caplog.records if "replayed" in r.getMessage()]
    assert len(replayed) == 1
    assert re.fullmatch(
        r"replayed 4 write-ahead log records after record 6 in [\d.]+ s "
        r"\(1 segments before it not read\)",
        replayed[0],
    ), replayed


@pytest.mark.slow
def test_a_standby_stopped_gracefully_resumes_after_its_snapshot(
    replicas: Any,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2, extra=("--sync-replicas", "1"))
    p = rs.primary()
    s = 1 - p
    rs.wait_sync()
    grads = _grads(6, 1000)
    with Client(rs.url, timeout=60) as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": 0 * grads[0]})
        for g in grads[:3]:
            c.push("g", g)
        rs.procs[s].send_signal(signal.SIGTERM)  # a last snapshot, after record 4
        assert rs.procs[s].wait(30) == 0
        rs.start(s)
        for g in grads[3:]:
            c.push("g", g)  # acknowledged once the standby holds them
    rs.wait_t(s, "g", 6)
    assert rs.state(s, "g")[1].tobytes() == _reference(grads).tobytes()
    standby = (tmp_path / f"server{s}-2.log").read_text()
    assert re.search(
        r"replayed 0 write-ahead log records after record 4 in [\d.]+ s "
        r"\(1 segments before it not read\)",
        standby,
    ), standby
    primary = (tmp_path / f"server{p}-1.log").read_text()
    joined = [ln for ln in primary.splitlines() if f"standby m{s} (" in ln]
    assert "sending snapshot" in joined[0]  # its first start: an empty data dir
    assert not any("sending snapshot" in ln for ln in joined[1:]), joined
    assert re.search(r"resumes after record 4 \(term \d+\)", joined[1]), joined


def _wait_line(log: Path, pattern: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while (found := re.search(pattern, log.read_text())) is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return found.group(0)


@pytest.mark.slow
def test_a_server_serves_while_its_kernels_compile_then_loads_them_from_the_cache(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    pytest.importorskip("numba")
    cache = tmp_path / "numba-cache"  # not there yet: numba creates it
    env = clean_env(NUMBA_CACHE_DIR=str(cache))
    grads = _grads(4, 100_003)
    log = tmp_path / "first.log"
    proc, address = server_processes(log, env=env)
    try:
        with Client(address, timeout=60) as c:
            c.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"x": 0 * grads[0]}
            )
            c.push("g", grads[0])
            ready = _wait_line(log, r"fused kernels ready in .*")
            c.push("g", grads[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    # it listened, and stepped with NumPy, before the kernels were in
    assert text.index("onnxps listening on") < text.index("fused kernels ready")
    until = "NumPy path until the fused kernels are loaded"
    assert text.index(until) < text.index("fused kernels ready")
    assert f"compiled and cached in {cache}/" in ready, ready
    assert cache.is_dir()

    log = tmp_path / "second.log"
    proc, address = server_processes(log, env=env)
    with Client(address, timeout=60) as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": 0 * grads[0]})
        ready = _wait_line(log, r"fused kernels ready in .*")
        for g in grads[:2]:
            c.push("g", g)
        assert c.pull("g")[0].tobytes() == _reference(grads[:2]).tobytes()
    assert f"loaded from numba's cache in {cache}/" in ready, ready
