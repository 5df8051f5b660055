"""Distributed training across real worker processes: sync steps, dead workers, async.

The server runs as ``onnxps serve`` in its own process and each worker is
``tests/workers/worker.py`` in its own process, all on 127.0.0.1.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from deadlines import waited_for
from onnxps.client import Adagrad, Adam, Async, Client, Sync
from onnxps.server.app import ServerHandle
from onnxps.server.kernels import AdagradAttrs, AdamAttrs, apply_onnx
from onnxps.server.store import Consistency, ParameterStore, StoreLimits
from workers.common import DTYPE, SHAPES, client_id, gradients, initial_values
from workers.procs import finish, server_process, start_worker

LR = 0.01


def _create(ps: Client, name: str, consistency: Sync | Async, seed: int) -> None:
    xs = initial_values(seed)
    ps.create_group(
        name,
        Adam(),
        learning_rate=LR,
        tensors=[(f"x{i}", x) for i, x in enumerate(xs)],
        consistency=consistency,
    )


def _reference_sync(seed: int, workers: int, steps: int) -> list[np.ndarray]:
    """The same training in one process: mean in sorted client-id order, then Adam."""
    xs = initial_values(seed)
    vs = [np.zeros_like(x) for x in xs]
    hs = [np.zeros_like(x) for x in xs]
    n = len(xs)
    for t in range(steps):
        per = {client_id(w): gradients(seed, w, t) for w in range(workers)}
        keys = sorted(per)
        gs = [np.array(g, copy=True) for g in per[keys[0]]]
        for k in keys[1:]:
            for a, g in zip(gs, per[k], strict=True):
                np.add(a, g, out=a)
        gs = [np.divide(a, DTYPE.type(workers)) for a in gs]
        out = apply_onnx("Adam", AdamAttrs(), [LR, t, *xs, *gs, *vs, *hs])
        xs, vs, hs = out[:n], out[n : 2 * n], out[2 * n :]
    return xs + vs + hs


@pytest.mark.slow
def test_six_sync_workers_match_one_process_bit_for_bit() -> None:
    workers, steps, seed = 6, 8, 11
    with server_process() as address, Client(address, timeout=30) as ps:
        _create(ps, "sync6", Sync(workers), seed)
        procs = [
            start_worker(address, "sync6", w, mode="sync", steps=steps, seed=seed)
            for w in range(workers)
        ]
        results = [finish(p) for p in procs]
        for code, out, err in results:
            assert code == 0, err
            assert out.splitlines()[-1] == f"done T={steps}"
        t, got = ps.pull_versioned("sync6", state=True)
        info = ps.describe_group("sync6")
    assert t == steps
    assert info.pending_contributions == 0
    assert sorted(w.worker_id for w in info.workers) == [
        client_id(w) for w in range(workers)
    ]
    assert all(not w.alive for w in info.workers)  # every worker left
    want = _reference_sync(seed, workers, steps)
    assert len(got) == len(want) == 3 * len(SHAPES)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == DTYPE
        np.testing.assert_array_equal(g, w, strict=True)


def _read_until(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return str(line.strip())
        if not line:
            break
    raise AssertionError(f"worker never printed {prefix!r}")


@pytest.mark.slow
def test_sigkilled_sync_worker_shrinks_the_quorum_and_training_finishes() -> None:
    workers, steps, lease = 4, 12, 1.0
    with server_process(lease_seconds=lease) as address, Client(address) as ps:
        _create(ps, "kill", Sync(workers), 3)
        procs = [
            start_worker(address, "kill", w, mode="sync", steps=steps, seed=3)
            for w in range(workers)
        ]
        victim = procs[-1]
        _read_until(victim, "step 2 ", timeout=30)
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert victim.stdout is not None and victim.stderr is not None
        victim.stdout.close()
        victim.stderr.close()
        results = [finish(p) for p in procs[:-1]]
        info = ps.describe_group("kill")
    for code, out, err in results:
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == "joined"
        assert [ln.split()[1] for ln in lines if ln.startswith("step")] == [
            str(k) for k in range(steps)
        ]
        assert lines[-1] == f"done T={steps}"
    assert info.update_count == steps
    assert info.pending_contributions == 0
    dead = {w.worker_id for w in info.workers if not w.alive}
    # Three left, one expired: the victim never pushes again, so every step after
    # its death was taken by a quorum of three (the lease stalled training once).
    assert dead == {client_id(w) for w in range(workers)}


@pytest.mark.slow
def test_eight_async_workers_500_pushes_each_make_t_4000() -> None:
    workers, pushes = 8, 500
    with server_process() as address, Client(address) as ps:
        ps.create_group(
            "async8",
            Adagrad(),
            learning_rate=LR,
            tensors=[(f"x{i}", x) for i, x in enumerate(initial_values(0))],
        )
        procs = [
            start_worker(address, "async8", w, mode="async", steps=pushes)
            for w in range(workers)
        ]
        results = [finish(p, timeout=55) for p in procs]
        t = ps.describe_group("async8").update_count
    finals = []
    for code, out, err in results:
        assert code == 0, err
        finals.append(int(out.splitlines()[-1].removeprefix("done T=")))
    assert t == workers * pushes == 4000
    assert max(finals) == 4000  # the last push of all saw T = 4000
    assert min(finals) >= pushes


def test_join_heartbeat_and_leave_show_in_describe_group(
    server: ServerHandle, client: Client
) -> None:
    x = np.zeros(4, np.float32)
    client.create_group(
        "leases",
        Adam(),
        learning_rate=0.1,
        tensors={"x": x},
        consistency=Sync(3),
        lease_seconds=0.6,
    )
    a = Client(server.address, client_id="a")
    b = Client(server.address, client_id="b")
    c = Client(server.address, client_id="c")
    try:
        lease = a.join("leases")
        assert lease.lease_seconds == pytest.approx(0.6)
        assert lease.quorum == 3
        b.join("leases")
        c.join("leases")
        time.sleep(1.5)  # 2.5 leases: only heartbeats keep them alive
        info = client.describe_group("leases")
        assert [(w.worker_id, w.alive) for w in info.workers] == [
            ("a", True),
            ("b", True),
            ("c", True),
        ]
        assert all(0 < w.lease_remaining_seconds <= 0.6 for w in info.workers)
        assert info.quorum == 3
        left = b.leave("leases")
        assert (left.live_workers, left.quorum) == (2, 2)
        c.close()  # heartbeats stop without a leave: the lease runs out
        deadline = time.monotonic() + 5
        while client.describe_group("leases").quorum != 1:
            assert time.monotonic() < deadline, "c's lease never expired"
            time.sleep(0.05)
        info = client.describe_group("leases")
        assert [(w.worker_id, w.alive) for w in info.workers] == [
            ("a", True),
            ("b", False),
            ("c", False),
        ]
        assert info.quorum == 1
        assert b.join("leases").quorum == 2  # rejoining restores its place
    finally:
        for cl in (a, b, c):
            cl.close()


def test_a_worker_dead_after_pushing_still_counts_toward_its_step() -> None:
    """Its gradient is in the step, so the step still waits for every live worker."""
    now = [0.0]
    store = ParameterStore(StoreLimits(default_lease_seconds=1.0), clock=lambda: now[0])
    store.create_group(
        "g",
        AdagradAttrs(),
        0.1,
        [("x", np.zeros(2, np.float64))],
        consistency=Consistency("sync", 3),
    )
    for w in "abc":
        store.join("g", w)
    store.push("g", [np.full(2, 3.0)], client_id="c", seq=1, base_version=0)
    now[0] = 0.9
    store.join("g", "a")
    store.join("g", "b")
    now[0] = 1.5  # c's lease ran out after it pushed
    store.reap_leases()
    view = store.describe("g")
    assert (list(view.dead_workers), view.quorum) == (["c"], 3)
    out = store.push("g", [np.full(2, 1.0)], client_id="a", seq=1, base_version=0)
    assert (out.update_count, out.applied) == (0, False)
    out = store.push("g", [np.full(2, 2.0)], client_id="b", seq=1, base_version=0)
    assert (out.update_count, out.applied) == (1, True)
    assert store.describe("g").quorum == 2  # the next step goes without c
    want = apply_onnx(
        "Adagrad", AdagradAttrs(), [0.1, 0, np.zeros(2), np.full(2, 2.0), np.zeros(2)]
    )
    np.testing.assert_array_equal(store.pull("g").arrays[0], want[0], strict=True)
    store.close()


def test_pull_min_version_waits_for_the_step_and_times_out(client: Client) -> None:
    client.create_group(
        "wait", Adam(), learning_rate=0.1, tensors={"x": np.zeros(3, np.float32)}
    )
    from onnxps.client import DeadlineExceededError

    with pytest.raises(DeadlineExceededError) as exc:
        client.pull("wait", min_version=1, timeout=0.4)
    assert waited_for(exc.value.details) == 0.4
    assert exc.value.code.name == "DEADLINE_EXCEEDED"
    got: list[tuple[int, list[np.ndarray]]] = []
    waiter = threading.Thread(
        target=lambda: got.append(client.pull_versioned("wait", min_version=2))
    )
    waiter.start()
    client.push("wait", np.ones(3, np.float32))
    time.sleep(0.2)
    assert got == []  # T=1 is not enough
    client.push("wait", np.ones(3, np.float32))
    waiter.join(timeout=10)
    assert got[0][0] == 2
    np.testing.assert_array_equal(got[0][1][0], client.pull("wait")[0], strict=True)


def test_a_heartbeat_that_finds_an_expired_lease_takes_the_due_step() -> None:
    """Whoever notices an expiry first (heartbeat, push or reaper) must step."""
    now = [0.0]
    store = ParameterStore(StoreLimits(default_lease_seconds=1.0), clock=lambda: now[0])
    store.create_group(
        "g",
        AdagradAttrs(),
        0.1,
        [("x", np.zeros(2, np.float64))],
        consistency=Consistency("sync", 3),
    )
    for w in "abc":
        store.join("g", w)
    now[0] = 0.5
    store.push("g", [np.full(2, 1.0)], client_id="a", seq=1, base_version=0)
    store.push("g", [np.full(2, 3.0)], client_id="b", seq=1, base_version=0)
    store.join("g", "a")
    now[0] = 1.2  # c's lease ran out; a's heartbeat is the first to see it
    lease = store.join("g", "b")
    assert lease.update_count == 1
    assert store.describe("g").pending == 0
    # Nothing is left for the reaper: the step happened exactly once.
    store.reap_leases()
    assert store.describe("g").update_count == 1
    want = apply_onnx(
        "Adagrad", AdagradAttrs(), [0.1, 0, np.zeros(2), np.full(2, 2.0), np.zeros(2)]
    )
    np.testing.assert_array_equal(store.pull("g").arrays[0], want[0], strict=True)
    store.close()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sync_combines_in_client_id_order_whatever_the_arrival_order(
    server: ServerHandle, client: Client, reduction: str
) -> None:
    """float32 1e8 + 1 - 1e8: 0 in id order (a, b, c), 1 in arrival order (c, a, b)."""
    client.create_group(
        "order",
        Adagrad(),
        learning_rate=0.1,
        tensors={"x": np.zeros(1, np.float32)},
        consistency=Sync(3, reduction),  # type: ignore[arg-type]
    )
    grads = {"c": -1e8, "a": 1e8, "b": 1.0}
    for cid, value in grads.items():  # arrival order c, a, b
        with Client(server.address, client_id=cid) as w:
            w.push("order", np.full(1, value, np.float32), base_version=0)
    t, (x, h) = client.pull_versioned("order", state=True)
    assert t == 1
    # Adagrad: H_new = H + G * G, so H shows the combined gradient G.
    assert h.tolist() == [0.0]
    assert x.tolist() == [0.0]
    assert np.float32(1e8) + np.float32(1.0) - np.float32(1e8) == 0  # a, b, c
    assert np.float32(-1e8) + np.float32(1e8) + np.float32(1.0) == 1  # c, a, b
