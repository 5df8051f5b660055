"""Row-sparse pushes and pulls: each row steps as the dense operator on that row.

Every test compares against a dense reference (a dense push on the same state, or
``apply_onnx`` on the rows) bit for bit, through a real server where it can.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    Momentum,
    OptimizerSpec,
    Sync,
)
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.errors import InvalidArgument
from onnxps.server.kernels import apply_onnx, make_attrs
from onnxps.server.store import ParameterStore

Array = np.ndarray[Any, Any]

OPTIMIZERS: dict[str, tuple[str, dict[str, Any], OptimizerSpec]] = {
    "adagrad": (
        "Adagrad",
        {"decay_factor": 0.1, "norm_coefficient": 0.01},
        Adagrad(decay_factor=0.1, norm_coefficient=0.01),
    ),
    "momentum": (
        "Momentum",
        {"alpha": 0.9, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.01},
        Momentum(alpha=0.9, beta=0.1, mode="standard", norm_coefficient=0.01),
    ),
    "nesterov": (
        "Momentum",
        {"alpha": 0.9, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.0},
        Momentum(alpha=0.9, beta=0.5, mode="nesterov", norm_coefficient=0.0),
    ),
    "adam": (
        "Adam",
        {"norm_coefficient": 0.01, "norm_coefficient_post": 0.02},
        Adam(norm_coefficient=0.01, norm_coefficient_post=0.02),
    ),
}
DTYPES = [np.float32, np.float64]


def _pair(
    op: str, attrs: dict[str, Any], dtype: Any, rows: int = 40, dim: int = 6
) -> tuple[ParameterStore, ParameterStore, Array]:
    x = np.random.default_rng(1).standard_normal((rows, dim)).astype(dtype)
    stores = ParameterStore(), ParameterStore()
    for s in stores:
        s.create_group(
            "g", make_attrs(op, attrs), 0.05, [("emb", x), ("b", np.ones(3, dtype))]
        )
    return stores[0], stores[1], x


def _state(store: ParameterStore) -> list[Array]:
    return list(store.pull("g", with_state=True).arrays)


def _equal(a: list[Array], b: list[Array]) -> bool:
    return all(u.tobytes() == v.tobytes() for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rows_covering_every_row_once_are_a_dense_push(name: str, dtype: Any) -> None:
    op, attrs, _ = OPTIMIZERS[name]
    dense, sparse, x = _pair(op, attrs, dtype)
    rng = np.random.default_rng(2)
    for _ in range(4):
        g = rng.standard_normal(tuple(x.shape)).astype(dtype)
        gb = rng.standard_normal(3).astype(dtype)
        dense.push("g", [g, gb])
        perm = rng.permutation(x.shape[0])
        sparse.push_rows("g", {"emb": (perm, g[perm]), "b": gb})
    assert dense.describe("g").update_count == sparse.describe("g").update_count == 4
    assert _equal(_state(dense), _state(sparse))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_touched_rows_step_like_the_operator_on_those_rows(
    name: str, dtype: Any
) -> None:
    """Lazy: untouched rows keep X, V, H; touched rows equal apply_onnx on them,
    with the group's T (which advances once per push)."""
    op, attrs, _ = OPTIMIZERS[name]
    store, _, x = _pair(op, attrs, dtype)
    nstate = 2 if op == "Adam" else 1
    ref = [x.copy()] + [np.zeros_like(x) for _ in range(nstate)]
    rng = np.random.default_rng(3)
    for t in range(5):
        idx = rng.choice(x.shape[0], size=7, replace=False)
        g = rng.standard_normal((7, x.shape[1])).astype(dtype)
        store.push_rows("g", {"emb": (idx, g)})
        rows = [a[idx] for a in ref]
        inputs = [
            np.array(0.05),  # R as the store holds it: float64
            np.array(t, np.int64),
            rows[0],
            g,
            *rows[1:],
        ]
        out = apply_onnx(op, attrs, inputs)
        for a, o in zip(ref, out, strict=True):
            a[idx] = o
    got = _state(store)
    n = 2  # tensors: emb, b
    assert _equal([got[k * n] for k in range(1 + nstate)], ref)
    assert store.describe("g").update_count == 5
    # "b" was never named: it kept its values and zero state
    assert got[1].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_indices_are_summed_in_push_order(dtype: Any) -> None:
    op, attrs, _ = OPTIMIZERS["adam"]
    dense, sparse, x = _pair(op, attrs, dtype)
    rng = np.random.default_rng(4)
    idx = np.array([5, 3, 5, 0, 5, 3], np.int64)
    g = rng.standard_normal((6, x.shape[1])).astype(dtype)
    full = np.zeros_like(x)
    full[5] = (g[0] + g[2]) + g[4]  # left to right, from the first occurrence
    full[3] = g[1] + g[5]
    full[0] = g[3]
    sparse.push_rows("g", {"emb": (idx, g)})
    # the dense reference steps rows 0, 3, 5 only (lazy): push those rows densely
    ref_rows = np.array([0, 3, 5])
    ref = _state(dense)
    nstate = 2
    rows = [ref[2 * k][ref_rows] for k in range(1 + nstate)]
    out = apply_onnx(
        op,
        attrs,
        [np.array(0.05), np.array(0, np.int64), rows[0], full[ref_rows]] + rows[1:],
    )
    got = _state(sparse)
    for k in range(1 + nstate):
        expect = ref[2 * k].copy()
        expect[ref_rows] = out[k]
        assert got[2 * k].tobytes() == expect.tobytes()


def test_empty_push_advances_t_and_changes_nothing() -> None:
    op, attrs, _ = OPTIMIZERS["adam"]
    store, _, x = _pair(op, attrs, np.float32)
    before = _state(store)
    out = store.push_rows(
        "g", {"emb": (np.empty(0, np.int64), np.empty((0, 6), np.float32))}
    )
    assert out.update_count == 1 and out.applied
    assert _equal(_state(store), before)
    assert store.push_rows("g", {}).update_count == 2


@pytest.mark.parametrize("bad", [[40], [-1], [0, 3, 99], [-7, 2]])
def test_out_of_range_indices_are_refused_with_state_unchanged(bad: list[int]) -> None:
    op, attrs, _ = OPTIMIZERS["adam"]
    store, _, _ = _pair(op, attrs, np.float32)
    before = _state(store)
    g = np.ones((len(bad), 6), np.float32)
    with pytest.raises(InvalidArgument) as err:
        store.push_rows("g", {"emb": (np.array(bad, np.int64), g)})
    assert err.value.reason == "ROW_INDEX_OUT_OF_RANGE"
    assert "[0, 40)" in str(err.value)
    assert store.describe("g").update_count == 0
    assert _equal(_state(store), before)


def test_shape_dtype_and_name_errors() -> None:
    op, attrs, _ = OPTIMIZERS["adam"]
    store, _, _ = _pair(op, attrs, np.float32)
    idx = np.array([1, 2], np.int64)
    cases = [
        ({"emb": (idx, np.ones((3, 6), np.float32))}, "SHAPE_MISMATCH"),
        ({"emb": (idx, np.ones((2, 5), np.float32))}, "SHAPE_MISMATCH"),
        ({"emb": (idx, np.ones((2, 6), np.float64))}, "DTYPE_MISMATCH"),
        ({"emb": (idx.astype(np.int32), np.ones((2, 6), np.float32))}, "ROW_INDICES"),
        ({"nope": (idx, np.ones((2, 6), np.float32))}, "UNKNOWN_TENSOR"),
        ({"emb": (idx, np.full((2, 6), np.nan, np.float32))}, "NON_FINITE_GRADIENT"),
    ]
    for grads, reason in cases:
        with pytest.raises(InvalidArgument) as err:
            store.push_rows("g", grads)  # type: ignore[arg-type]
        assert err.value.reason == reason, grads
    assert store.describe("g").update_count == 0


def test_exactly_once_and_staleness_as_for_dense_pushes() -> None:
    store = ParameterStore()
    attrs = make_attrs("Adagrad", {})
    x = np.zeros((10, 2), np.float32)
    store.create_group("g", attrs, 0.1, [("emb", x)])
    rows = {"emb": (np.array([1]), np.ones((1, 2), np.float32))}
    first = store.push_rows("g", rows, client_id="c", seq=7)  # type: ignore[arg-type]
    again = store.push_rows("g", rows, client_id="c", seq=7)  # type: ignore[arg-type]
    assert (first.update_count, first.duplicate) == (1, False)
    assert (again.update_count, again.duplicate) == (1, True)
    # the dense and row pushes of one client share one window of seqs
    dup = store.push("g", [np.ones((10, 2), np.float32)], client_id="c", seq=7)
    assert dup.duplicate and store.describe("g").update_count == 1


def test_sync_rows_are_combined_like_dense_pushes() -> None:
    """Two workers' rows: sum in client-id order, then the mean, one step."""
    attrs = make_attrs("Adam", {})
    x = np.random.default_rng(5).standard_normal((12, 3)).astype(np.float32)
    sparse, dense = ParameterStore(), ParameterStore()
    for s in (sparse, dense):
        s.create_group("g", attrs, 0.1, [("emb", x)], consistency=_sync(2))
    rng = np.random.default_rng(6)
    ga = rng.standard_normal((12, 3)).astype(np.float32)
    gb = rng.standard_normal((12, 3)).astype(np.float32)
    pa, pb_ = rng.permutation(12), rng.permutation(12)
    out = sparse.push_rows("g", {"emb": (pa, ga[pa])}, client_id="b", seq=1)
    assert not out.applied
    out = sparse.push_rows("g", {"emb": (pb_, gb[pb_])}, client_id="a", seq=1)
    assert out.applied and out.update_count == 1
    dense.push("g", [ga], client_id="b", seq=1)
    dense.push("g", [gb], client_id="a", seq=1)
    assert _equal(_state(sparse), _state(dense))


def _sync(n: int) -> Any:
    from onnxps.server.store import Consistency

    return Consistency(mode="sync", sync_workers=n)


# -- through the server ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_server_row_push_congruent_with_dense_push(
    client: Client, name: str, dtype: Any
) -> None:
    _, _, spec = OPTIMIZERS[name]
    x = np.random.default_rng(7).standard_normal((64, 5)).astype(dtype)
    for group in ("dense", "rows"):
        client.create_group(
            group, spec, learning_rate=0.05, tensors={"emb": x, "b": np.zeros(2, dtype)}
        )
    rng = np.random.default_rng(8)
    for _ in range(3):
        g = rng.standard_normal(tuple(x.shape)).astype(dtype)
        gb = rng.standard_normal(2).astype(dtype)
        client.push("dense", g, gb)
        perm = rng.permutation(64)
        client.push_rows("rows", {"emb": (perm, g[perm]), "b": gb})
    a = client.pull("dense", state=True)
    b = client.pull("rows", state=True)
    assert _equal(a, b)
    got = client.pull_rows("rows", {"emb": [3, 3, 0]}, state=True)
    names = ["emb", "V:emb", "H:emb"] if name == "adam" else None
    if names:
        assert list(got) == names
    assert got["emb"].tobytes() == b[0][[3, 3, 0]].tobytes()


def test_server_large_row_push_is_chunked(server: Any) -> None:
    """100,000 rows of 16 float32 (6.4 MB with the indices) through small chunks."""
    with Client(server.address, timeout=60.0) as c:
        c.chunk_bytes = 64 * 1024
        x = np.zeros((200_000, 16), np.float32)
        c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"emb": x})
        idx = np.random.default_rng(9).integers(0, 200_000, 100_000)
        g = np.ones((100_000, 16), np.float32)
        assert c.push_rows("big", {"emb": (idx, g)}).update_count == 1
        rows = c.pull_rows("big", {"emb": idx[:5000]})["emb"]
        assert rows.shape == (5000, 16)
        assert np.all(rows < 0)
        untouched = np.setdiff1d(np.arange(200_000), idx)[:100]
        assert np.all(c.pull_rows("big", {"emb": untouched})["emb"] == 0)


def test_server_errors_are_invalid_argument(client: Client) -> None:
    client.create_group(
        "t", Adam(), learning_rate=0.1, tensors={"emb": np.zeros((4, 2), np.float32)}
    )
    with pytest.raises(InvalidArgumentError) as err:
        client.push_rows("t", {"emb": ([4], np.ones((1, 2), np.float32))})
    assert err.value.reason == "ROW_INDEX_OUT_OF_RANGE"
    with pytest.raises(InvalidArgumentError):
        client.push_rows("t", {"emb": ([-1], np.ones((1, 2), np.float32))})
    with pytest.raises(InvalidArgumentError):
        client.pull_rows("t", {"emb": [0, 9]})
    with pytest.raises(InvalidArgumentError) as err:
        client.push_rows("t", {"emb": ([0], np.ones((1, 3), np.float32))})
    assert err.value.reason == "SHAPE_MISMATCH"
    assert client.describe_group("t").update_count == 0


def test_server_sync_staleness(client: Client) -> None:
    client.create_group(
        "s",
        Adagrad(),
        learning_rate=0.1,
        tensors={"emb": np.zeros((4, 2), np.float32)},
        consistency=Sync(workers=1),
    )
    rows = {"emb": ([1], np.ones((1, 2), np.float32))}
    assert client.push_rows("s", rows, base_version=0).update_count == 1
    with pytest.raises(FailedPreconditionError) as err:
        client.push_rows("s", rows, base_version=0)
    assert err.value.reason == "STALE_PUSH"


# -- durability: kill -9 in WAL mode ---------------------------------------------------
SERVER = r"""
import sys, threading
from onnxps.server.app import ServerConfig, create_server
handle = create_server(ServerConfig(
    address="127.0.0.1:0", durability="wal", data_dir=sys.argv[1])).start()
print(handle.port, flush=True)
threading.Event().wait()
"""


def _start(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(data)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "server did not start"
    return proc, f"127.0.0.1:{int(line)}"


@pytest.mark.slow
def test_kill_9_in_wal_mode_keeps_every_acknowledged_row_push(tmp_path: Path) -> None:
    proc, address = _start(tmp_path / "data")
    x = np.random.default_rng(10).standard_normal((1000, 8)).astype(np.float32)
    local = ParameterStore()
    local.create_group("e", make_attrs("Adam", {}), 0.01, [("emb", x)])
    rng = np.random.default_rng(11)
    try:
        with Client(address, timeout=30.0) as c:
            c.create_group("e", Adam(), learning_rate=0.01, tensors={"emb": x})
            for _ in range(30):
                idx = rng.integers(0, 1000, 64)
                g = rng.standard_normal((64, 8)).astype(np.float32)
                c.push_rows("e", {"emb": (idx, g)})
                local.push_rows("e", {"emb": (idx, g)})
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    proc, address = _start(tmp_path / "data")
    try:
        with Client(address, timeout=30.0) as c:
            assert c.describe_group("e").update_count == 30
            assert _equal(c.pull("e", state=True), _state_of(local, "e"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def _state_of(store: ParameterStore, name: str) -> list[Array]:
    return list(store.pull(name, with_state=True).arrays)


def test_snapshot_keeps_rows_and_pending_sync_rows(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    config = ServerConfig(
        address="127.0.0.1:0", durability="snapshot", data_dir=str(tmp_path)
    )
    handle = servers(config)
    with Client(handle.address, timeout=30.0) as c:
        c.create_group(
            "s",
            Adagrad(),
            learning_rate=0.1,
            tensors={"emb": np.zeros((6, 2), np.float32)},
            consistency=Sync(workers=2),
        )
        out = c.push_rows("s", {"emb": ([2, 2], np.ones((2, 2), np.float32))})
        assert not out.applied
        c.save()
    handle.stop(grace=0)
    handle = servers(config)
    with Client(handle.address, timeout=30.0) as c2:
        out = c2.push_rows("s", {"emb": ([3], np.ones((1, 2), np.float32))})
        assert out.applied and out.update_count == 1
        rows = c2.pull_rows("s", {"emb": [0, 2, 3]})["emb"]
        # mean of the two pushes: row 2 got (1+1)/2 = 1, row 3 got 1/2
        assert rows[0].tolist() == [0.0, 0.0]
        assert rows[1][0] < rows[2][0] < 0


# -- four worker processes on one 1M x 64 table ----------------------------------------
WORKER = r"""
import sys
import numpy as np
from onnxps.client import Client

address, worker, pushes, rows, dim, k = sys.argv[1:]
worker, pushes, rows, dim, k = int(worker), int(pushes), int(rows), int(dim), int(k)
with Client(address, timeout=120.0) as c:
    for p in range(pushes):
        rng = np.random.default_rng([worker, p])
        idx = rng.integers(0, rows, k)  # with repeats
        g = rng.standard_normal((k, dim)).astype(np.float32)
        t = c.push_rows("table", {"emb": (idx, g)}).update_count
        print(worker, p, t, flush=True)
"""

TABLE_ROWS, TABLE_DIM, WORKERS, PUSHES, PUSH_ROWS = 1_000_000, 64, 4, 12, 4096


@pytest.mark.slow
def test_four_worker_processes_equal_a_serial_replay_in_server_order(
    server: Any,
) -> None:
    """Async pushes apply one at a time: the T each push got back is its place in
    the server's order, and replaying the pushes in that order gives every row."""
    x = np.random.default_rng(12).standard_normal((TABLE_ROWS, TABLE_DIM))
    x = x.astype(np.float32)
    with Client(server.address, timeout=120.0) as c:
        c.create_group("table", Adam(), learning_rate=0.01, tensors={"emb": x})
        args = [str(a) for a in (TABLE_ROWS, TABLE_DIM, PUSH_ROWS)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, server.address, str(w), str(PUSHES)]
                + [args[0], args[1], args[2]],
                stdout=subprocess.PIPE,
                text=True,
            )
            for w in range(WORKERS)
        ]
        order: dict[int, tuple[int, int]] = {}
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0
            for line in out.split("\n"):
                if line:
                    w, p, t = map(int, line.split())
                    order[t] = (w, p)
        assert sorted(order) == list(range(1, WORKERS * PUSHES + 1))
        replay = ParameterStore()
        replay.create_group("table", make_attrs("Adam", {}), 0.01, [("emb", x)])
        touched = []
        for t in sorted(order):
            rng = np.random.default_rng(list(order[t]))
            idx = rng.integers(0, TABLE_ROWS, PUSH_ROWS)
            g = rng.standard_normal((PUSH_ROWS, TABLE_DIM)).astype(np.float32)
            replay.push_rows("table", {"emb": (idx, g)})
            touched.append(idx)
        expect = replay.pull("table", with_state=True).arrays
        got = c.pull("table")[0]
        assert got.tobytes() == expect[0].tobytes()
        rows = np.unique(np.concatenate(touched))
        state = c.pull_rows("table", {"emb": rows}, state=True)
        assert state["V:emb"].tobytes() == expect[1][rows].tobytes()
        assert state["H:emb"].tobytes() == expect[2][rows].tobytes()
