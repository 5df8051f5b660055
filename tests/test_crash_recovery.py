"""kill -9 a real server process under push load, restart it, and check what survived.

Each async group has one writer, so its pushes apply in the writer's order and the
state after T pushes can be recomputed locally with ``apply_onnx``; the sync group's
steps combine both workers' gradients for that step in client-id order. After every
restart each group must equal the state after a prefix of its pushes, and with
``--durability wal`` that prefix must hold every acknowledged push.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    FailedPreconditionError,
    Momentum,
    ResourceExhaustedError,
    RpcError,
    Sync,
)
from onnxps.server.durability._snapshot import list_snapshots, load_snapshot
from onnxps.server.durability._wal import (
    FRAME,
    SEGMENT_HEADER,
    read_segments,
    segment_paths,
)
from onnxps.server.kernels import apply_onnx
from onnxps.server.store import combine_contributions

pytestmark = pytest.mark.slow  # kill -9 loops of real server processes, under load

SERVER = r"""
import logging, resource, signal, sys, threading
from onnxps.server.app import ServerConfig, create_server

mode, data_dir, interval, fsize = sys.argv[1:]
interval, fsize = float(interval), int(fsize)
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
if fsize:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, hard))
    # SIGUSR1: the operator made room (the soft limit goes back up)
    signal.signal(signal.SIGUSR1, lambda *a: resource.setrlimit(
        resource.RLIMIT_FSIZE, (hard, hard)))
config = ServerConfig(
    address="127.0.0.1:0", durability=mode, data_dir=data_dir,
    snapshot_interval=interval, threads=16,
)
handle = create_server(config).start()
print(handle.port, flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
done.wait()
handle.stop(grace=1)
"""

ASYNC = {
    "adam": ("Adam", {}, 0.01, np.float32, 16),
    "mom": ("Momentum", {"alpha": 0.9, "beta": 0.5, "mode": "nesterov",
                         "norm_coefficient": 0.01}, 0.05, np.float64, 8),
}  # fmt: skip
SYNC_LR = 0.1
SYNC_WORKERS = ("s0", "s1")


class Server:
    def __init__(self, data_dir: Path, mode: str, interval: float = 0, fsize: int = 0):
        self.stderr = open(data_dir.parent / f"{data_dir.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                mode,
                str(data_dir),
                str(interval),
                str(fsize),
            ],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"server did not start: see {self.stderr.name}"
        self.address = f"127.0.0.1:{int(line)}"

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.close()

    def close(self) -> None:
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.stderr.close()


def _grad(name: str, k: int, n: int, dtype: Any) -> np.ndarray:
    seed = sum(map(ord, name)) * 100_003 + k
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


class Model:
    """The state after T pushes, recomputed locally (and cached)."""

    def __init__(self) -> None:
        self.states: dict[str, list[list[np.ndarray]]] = {}
        for g, (op, _, _, dtype, n) in ASYNC.items():
            nstate = 2 if op == "Adam" else 1
            x0 = np.linspace(-1, 1, n).astype(dtype)
            self.states[g] = [[x0] + [np.zeros(n, dtype)] * nstate]
        self.states["sync"] = [[np.ones(8, np.float32), np.zeros(8, np.float32)]]

    def at(self, g: str, t: int) -> list[np.ndarray]:
        history = self.states[g]
        while len(history) <= t:
            k = len(history) - 1
            x, *state = history[-1]
            if g == "sync":
                grads = {w: [_grad(w, k, 8, np.float32)] for w in SYNC_WORKERS}
                (grad,) = combine_contributions(grads, "mean", np.dtype(np.float32))
                out = apply_onnx("Adagrad", {}, [SYNC_LR, k, x, grad, *state])
            else:
                op, attrs, lr, dtype, n = ASYNC[g]
                out = apply_onnx(op, attrs, [lr, k, x, _grad(g, k, n, dtype), *state])
            history.append(out)
        return history[t]


def _create(address: str) -> None:
    with Client(address) as c:
        c.create_group(
            "adam", Adam(), learning_rate=0.01,
            tensors={"w": np.linspace(-1, 1, 16).astype(np.float32)},
        )  # fmt: skip
        c.create_group(
            "mom", Momentum(0.9, 0.5, "nesterov", 0.01), learning_rate=0.05,
            tensors={"w": np.linspace(-1, 1, 8)},
        )  # fmt: skip
        c.create_group(
            "sync", Adagrad(), learning_rate=SYNC_LR,
            tensors={"w": np.ones(8, np.float32)}, consistency=Sync(2),
        )  # fmt: skip


def _async_writer(
    address: str, g: str, stop: threading.Event, acked: dict[str, int]
) -> None:
    _, _, _, dtype, n = ASYNC[g]
    with Client(address, client_id=f"w-{g}", timeout=3) as c:
        try:
            t = c.pull_versioned(g)[0]
            while not stop.is_set():
                assert c.push(g, _grad(g, t, n, dtype)) == t + 1
                t += 1
                acked[g] = t
        except RpcError:
            return


def _sync_worker(
    address: str, w: str, stop: threading.Event, acked: dict[str, int]
) -> None:
    with Client(address, client_id=w, timeout=3) as c:
        try:
            while not stop.is_set():
                t = c.pull_versioned("sync")[0]
                try:
                    c.push("sync", _grad(w, t, 8, np.float32), base_version=t)
                    acked[w] = max(acked[w], t + 1)
                except FailedPreconditionError:
                    pass  # pushed for step t before the restart, or t is stale
                c.pull("sync", min_version=t + 1, timeout=1.5)
        except RpcError:
            return


def _read_settled(c: Client, g: str) -> tuple[int, list[np.ndarray], int]:
    """T, X with its state, and the pending sync contributions, all of one version.

    A restarted server may still take one sync step by itself: when the kill fell
    after the completing push's record was durable but before the step's own record
    was, both contributions are replayed as pending (the quorum is reached) and the
    lease reaper takes the step within 0.1 s of the start. The writers are stopped,
    so nothing else moves T: read again until T did not move between the two calls.
    """
    for _ in range(50):
        t, values = c.pull_versioned(g, state=True)
        info = c.describe_group(g)
        if info.update_count == t:
            return t, values, info.pending_contributions
        time.sleep(0.05)
    raise AssertionError(f"{g}: T still moves after the restart (T={t})")


def _check(
    address: str, model: Model, acked: dict[str, int], wal: bool
) -> dict[str, int]:
    seen = {}
    with Client(address, timeout=10) as c:
        for g in [*ASYNC, "sync"]:
            t, values, pending = _read_settled(c, g)
            expected = model.at(g, t)
            for got, want in zip(values, expected, strict=True):
                assert got.tobytes() == want.tobytes(), f"{g} at T={t}"
            seen[g] = t
            if g != "sync":
                assert t <= acked[g] + 1, f"{g}: T={t}, only {acked[g]} acked"
                if wal:
                    assert t >= acked[g], f"{g}: T={t} lost acked pushes ({acked[g]})"
                continue
            if wal:
                assert all(acked[w] <= t + 1 for w in SYNC_WORKERS), (t, acked)
                waiting = [w for w in SYNC_WORKERS if acked[w] == t + 1]
                assert pending >= len(waiting), (t, acked, pending)
    return seen


def _kill_cycles(
    tmp_path: Path, mode: str, cycles: int, interval: float
) -> dict[str, Any]:
    data = tmp_path / "data"
    model = Model()
    acked = {"adam": 0, "mom": 0, "s0": 0, "s1": 0}
    rng = random.Random(6)
    progress = {}
    server = Server(data, mode, interval)
    try:
        _create(server.address)
        for _ in range(cycles):
            stop = threading.Event()
            threads = [
                threading.Thread(
                    target=_async_writer, args=(server.address, g, stop, acked)
                )
                for g in ASYNC
            ] + [
                threading.Thread(
                    target=_sync_worker, args=(server.address, w, stop, acked)
                )
                for w in SYNC_WORKERS
            ]
            for th in threads:
                th.start()
            time.sleep(rng.uniform(0.15, 0.7))
            server.kill()
            stop.set()
            server = Server(data, mode, interval)  # restarts while the workers fail
            for th in threads:
                th.join(timeout=10)
            progress = _check(server.address, model, acked, wal=mode == "wal")
    finally:
        server.kill()
    return {"progress": progress, "acked": acked}


def test_kill_9_under_load_wal_loses_no_acknowledged_push(tmp_path: Path) -> None:
    result = _kill_cycles(tmp_path, "wal", cycles=20, interval=0.3)
    # the load really ran: many pushes survived 20 kills
    assert result["progress"]["adam"] >= 20
    assert result["progress"]["sync"] >= 5
    assert result["acked"]["adam"] <= result["progress"]["adam"]


def _cut_last_record(wal_dir: Path) -> str:
    """Cut the log's last record off (a kill before its fsync); returns its op."""
    _, path = segment_paths(str(wal_dir))[-1]
    data = Path(path).read_bytes()
    pos = last = SEGMENT_HEADER.size
    while pos < len(data):
        last = pos
        _, hlen, blen, _ = FRAME.unpack_from(data, pos)
        pos += FRAME.size + hlen + blen
    *_, (header, _) = read_segments(str(wal_dir), 0)
    os.truncate(path, last)
    return str(header["op"])


def test_kill_9_after_a_sync_push_before_its_step_is_logged(tmp_path: Path) -> None:
    """The kill falls after the completing push of a sync step is durable, but before
    the step's own record is: the restarted server replays both contributions and,
    the quorum being reached, takes the step before it serves anything (so it never
    shows a full quorum pending). s1's acknowledged push is in the step, not lost."""
    data = tmp_path / "data"
    server = Server(data, "wal")
    try:
        _create(server.address)
        for w in ("s1", "s0"):  # s1's push is acknowledged, s0's is not (the kill)
            with Client(server.address, client_id=w) as c:
                c.push("sync", _grad(w, 0, 8, np.float32), base_version=0)
    finally:
        server.kill()
    assert _cut_last_record(data / "wal") == "sync_step"
    acked = {"adam": 0, "mom": 0, "s0": 0, "s1": 1}
    model = Model()
    server = Server(data, "wal")
    try:
        started = time.monotonic()
        seen = []
        while time.monotonic() - started < 0.5:  # across the reaper's step
            seen.append(_check(server.address, model, acked, wal=True)["sync"])
        assert seen and set(seen) == {1}, seen
        with Client(server.address) as c:
            info = c.describe_group("sync")
            assert (info.update_count, info.pending_contributions) == (1, 0)
    finally:
        server.kill()
    log = (tmp_path / "data.log").read_text()
    assert "Traceback" not in log


def test_kill_9_under_load_snapshot_mode_keeps_a_prefix(tmp_path: Path) -> None:
    result = _kill_cycles(tmp_path, "snapshot", cycles=4, interval=0.1)
    assert result["progress"]["adam"] >= 1


def test_disk_failure_while_snapshotting_keeps_serving(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Server(data, "snapshot", fsize=256 * 1024)
    try:
        with Client(server.address, timeout=10) as c:
            c.create_group(
                "small", Adam(), learning_rate=0.1, tensors={"w": np.zeros(8)}
            )
            c.push("small", np.ones(8))
            first = c.save()
            c.create_group(
                "big", Adam(), learning_rate=0.1, tensors={"w": np.zeros(64 * 1024)}
            )
            with pytest.raises(FailedPreconditionError, match="snapshot to .* failed"):
                c.save()
            with grpc.insecure_channel(server.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5
                )
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert c.push("small", np.ones(8)) == 2  # still serving from memory
            assert c.pull("big")[0].shape == (64 * 1024,)
    finally:
        server.kill()
    log = (tmp_path / "data.log").read_text()
    assert "ERROR onnxps.durability: snapshot to" in log
    assert "File too large" in log
    snaps = list_snapshots(str(data / "snapshots"))
    assert [p for _, p in snaps] == [first.path]  # the failed one left nothing behind
    manifest, groups = load_snapshot(first.path)
    assert [g.image.name for g in groups] == ["small"]
    assert groups[0].image.definition.update_count == 1


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def _pusher(address: str, i: int, acked: list[int], refused: list[str]) -> None:
    """Push until the log refuses a push (after the client's resends)."""
    with Client(address, client_id=f"p{i}", timeout=60) as c:
        while acked[i] < 200:
            try:
                c.push("g", _grad("g", i, 512, np.float64))
                acked[i] += 1
            except ResourceExhaustedError as exc:  # at once: not resent
                refused.append(str(exc))
                return


def test_a_full_disk_in_wal_mode_refuses_pushes_and_loses_no_acknowledged_one(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    # the create record is 12 KiB, a push 4 KiB: the log hits 64 KiB after ~12
    server = Server(data, "wal", fsize=64 * 1024)
    clients = 8
    acked, refused = [0] * clients, []  # type: ignore[var-annotated]
    try:
        with Client(server.address, timeout=10) as c:
            c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(512)})
            threads = [
                threading.Thread(
                    target=_pusher, args=(server.address, i, acked, refused)
                )
                for i in range(clients)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=120)
            assert len(refused) == clients, "the log never filled up"
            assert 5 <= sum(acked) <= 16, acked
            assert "write-ahead log in" in refused[0]
            assert "File too large" in refused[0]
            assert "this change was not applied" in refused[0]
            assert _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            # a refused push leaves T and X as they were
            t, before = c.pull_versioned("g", state=True)
            assert t == sum(acked)
            # A batch of several pushes refused whole is cut back off the log, which
            # may leave room for one smaller record: push until the log is full
            # again (each push either applied, T + 1, or refused, T unchanged).
            refusal: ResourceExhaustedError | None = None
            for _ in range(16):
                try:
                    assert c.push("g", np.ones(512)) == t + 1
                except ResourceExhaustedError as exc:
                    refusal = exc
                    break
                t, before = c.pull_versioned("g", state=True)
            assert refusal is not None, "the log never filled up again"
            assert "not applied" in str(refusal)
            assert refusal.reason == "DISK_FULL"
            assert refusal.metadata["errno"] == str(errno.EFBIG)
            t_after, after = c.pull_versioned("g", state=True)
            assert t_after == t
            assert [a.tobytes() for a in after] == [a.tobytes() for a in before]
            # room is made: the log writes again, and health says so
            server.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            c.set_learning_rate("g", 0.05)
            assert c.push("g", np.ones(512)) == t + 1
            assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
            t, before = c.pull_versioned("g", state=True)
    finally:
        server.kill()
    log = (tmp_path / "data.log").read_text()
    assert "ERROR onnxps.durability: write-ahead log in" in log
    assert "File too large" in log
    assert "is written again" in log
    restarted = Server(data, "wal")
    try:
        with Client(restarted.address, timeout=10) as c:
            t_restored, restored = c.pull_versioned("g", state=True)
            assert t_restored == t  # every acknowledged push, no refused one
            assert [a.tobytes() for a in restored] == [a.tobytes() for a in before]
            assert c.describe_group("g").learning_rate == 0.05
            assert c.push("g", np.ones(512)) == t + 1  # and the log goes on
    finally:
        restarted.kill()
    log = (tmp_path / "data.log").read_text()
    assert "records are missing" not in log  # refused lsns are declared void
    assert "Traceback" not in log
