"""Pushes to one group share fsyncs in --durability wal, and still step in log order.

An async push appends its record under the group's lock and waits for the fsync
without it; it steps in its record's turn (``server/store/_order.py``). So the state is
the serial replay of the acknowledged pushes in T order, the log holds them in that
order, and a refused push (a full disk) leaves exactly the acknowledged ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _servers import Server
from onnxps.client import Adam, Client, ResourceExhaustedError
from onnxps.server.app import ServerHandle
from onnxps.server.durability._wal import read_segments
from onnxps.server.kernels import apply_onnx

N = 64
X0 = np.linspace(-1, 1, N)


@pytest.fixture
def wal_servers(
    servers: Callable[..., ServerHandle],
) -> Callable[[Path], ServerHandle]:
    """``wal_servers(data_dir)``: a started server logging to ``data_dir``."""

    def start(data_dir: Path) -> ServerHandle:
        return servers(
            durability="wal", data_dir=str(data_dir), snapshot_interval=0, threads=16
        )

    return start


def _grad(client: int, k: int) -> np.ndarray:
    return np.random.default_rng(client * 10_007 + k).standard_normal(N)


def _replay(grads: Sequence[np.ndarray], lr: float = 0.01) -> list[np.ndarray]:
    """X, V, H after stepping Adam with ``grads`` in order from X0."""
    x, v, h = X0.copy(), np.zeros(N), np.zeros(N)
    for t, g in enumerate(grads):
        x, v, h = apply_onnx("Adam", {}, [lr, t, x, g, v, h])
    return [x, v, h]


def _create(address: str) -> None:
    with Client(address, timeout=20) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": X0})


def _logged_pushes(data_dir: Path) -> list[dict[str, Any]]:
    return [h for h, _ in read_segments(str(data_dir / "wal"), 0) if h["op"] == "push"]


class HeldJournal:
    """The server's write-ahead log, with the first push's wait held open after its
    record is durable; it counts the push records logged."""

    def __init__(self, journal: Any) -> None:
        self.journal = journal
        self.pushes = 0
        self.held: int | None = None
        self.waiting = threading.Event()
        self.release = threading.Event()

    def log(self, record: dict[str, Any], arrays: Sequence[Any]) -> int:
        lsn = int(self.journal.log(record, arrays))
        if record["op"] == "push":
            self.pushes += 1
            if self.held is None:
                self.held = lsn
        return lsn

    def check_writable(self) -> None:
        self.journal.check_writable()

    def wait(self, lsn: int) -> None:
        self.journal.wait(lsn)
        if lsn == self.held:
            self.waiting.set()
            assert self.release.wait(20)


def test_a_push_is_logged_while_the_one_before_it_waits_and_steps_after_it(
    wal_servers: Callable[[Path], ServerHandle], tmp_path: Path
) -> None:
    server = wal_servers(tmp_path / "data")
    assert server.durability is not None
    held = HeldJournal(server.durability.journal)
    server.store.set_journal(held)
    _create(server.address)
    replies: dict[int, Any] = {}

    def push(i: int) -> None:
        with Client(server.address, client_id=f"c{i}", timeout=30) as c:
            replies[i] = c.push_detailed("g", _grad(i, 0), return_values=True)

    first = threading.Thread(target=push, args=(0,))
    first.start()
    assert held.waiting.wait(20)
    second = threading.Thread(target=push, args=(1,))
    second.start()
    # The first push's record is durable and its wait held: the second is logged
    # without waiting for it (it would wait for the group's lock if it held it).
    deadline = time.monotonic() + 20
    while held.pushes < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.pushes == 2
    assert replies == {}  # the second steps only after the first, which is held
    held.release.set()
    first.join(30)
    second.join(30)
    assert (replies[0].update_count, replies[1].update_count) == (1, 2)
    x1, _, _ = _replay([_grad(0, 0)])
    x2, _, _ = _replay([_grad(0, 0), _grad(1, 0)])
    assert replies[0].values[0].tobytes() == x1.tobytes()
    assert replies[1].values[0].tobytes() == x2.tobytes()
    assert [(h["client_id"], h["t"]) for h in _logged_pushes(tmp_path / "data")] == [
        ("c0", 0),
        ("c1", 1),
    ]


def test_concurrent_pushes_to_one_group_are_a_serial_replay_in_t_order(
    wal_servers: Callable[[Path], ServerHandle], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    server = wal_servers(data)
    _create(server.address)
    clients, pushes = 8, 25
    by_t: dict[int, tuple[int, int]] = {}  # T -> (client, k)

    def pusher(i: int) -> None:
        with Client(server.address, client_id=f"c{i}", timeout=60) as c:
            for k in range(pushes):
                by_t[c.push("g", _grad(i, k))] = (i, k)

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    total = clients * pushes
    assert sorted(by_t) == list(range(1, total + 1))
    expected = _replay([_grad(*by_t[t]) for t in range(1, total + 1)])
    with Client(server.address, timeout=20) as c:
        t, values = c.pull_versioned("g", state=True)
    assert t == total
    assert [a.tobytes() for a in values] == [a.tobytes() for a in expected]
    # The log holds them in T order, each naming the T it stepped at.
    logged = _logged_pushes(data)
    assert [(h["client_id"], h["t"]) for h in logged] == [
        (f"c{by_t[t][0]}", t - 1) for t in range(1, total + 1)
    ]
    # ... and replays to the same state.
    server.stop(grace=0)
    restarted = wal_servers(data)
    with Client(restarted.address, timeout=20) as c:
        t, values = c.pull_versioned("g", state=True)
    assert t == total
    assert [a.tobytes() for a in values] == [a.tobytes() for a in expected]


@pytest.mark.slow
def test_a_full_disk_amid_concurrent_pushes_keeps_the_replay_of_the_acked_ones(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    # The create record is ~1.5 KiB and a push ~0.8 KiB: the log fills after ~70
    # pushes, while 8 clients push at once.
    server = Server(data, "wal", fsize=64 * 1024)
    clients = 8
    by_t: dict[int, tuple[int, int]] = {}
    refused: list[str] = []

    def pusher(i: int) -> None:
        with Client(server.address, client_id=f"c{i}", timeout=60) as c:
            for k in range(400):
                try:
                    by_t[c.push("g", _grad(i, k))] = (i, k)
                except ResourceExhaustedError as exc:
                    refused.append(str(exc.reason))
                    return

    try:
        _create(server.address)
        threads = [threading.Thread(target=pusher, args=(i,)) for i in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert refused == ["DISK_FULL"] * clients, "the log never filled up"
        acked = len(by_t)
        assert sorted(by_t) == list(range(1, acked + 1))
        expected = _replay([_grad(*by_t[t]) for t in range(1, acked + 1)])
        with Client(server.address, timeout=20) as c:
            t, values = c.pull_versioned("g", state=True)
        assert t == acked
        assert [a.tobytes() for a in values] == [a.tobytes() for a in expected]
    finally:
        server.kill()
    restarted = Server(data, "wal")
    try:
        with Client(restarted.address, timeout=20) as c:
            t, values = c.pull_versioned("g", state=True)
    finally:
        restarted.kill()
    assert t == acked
    assert [a.tobytes() for a in values] == [a.tobytes() for a in expected]
    log = (tmp_path / "data.log").read_text()
    assert "File too large" in log
    assert "records are missing" not in log
    assert "Traceback" not in log
