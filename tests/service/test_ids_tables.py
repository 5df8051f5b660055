"""Tables keyed by arbitrary int64 ids: rows created on first push from a seeded,
documented initializer, stepped lazily as a fixed table's rows.

The reference for an ids table is a fixed (rows, dim) table holding the initial
rows of every id a test uses, pushed with each id's position: the ids table must
match it bit for bit.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    AsyncClient,
    Client,
    IdsTable,
    InvalidArgumentError,
    Momentum,
    Normal,
    ResourceExhaustedError,
    Sync,
    Uniform,
    Zeros,
)
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore, StoreLimits
from onnxps.wire.initializers import initial_rows

Array = np.ndarray[Any, Any]
ATTRS: dict[str, dict[str, Any]] = {
    "Adagrad": {"decay_factor": 0.1, "norm_coefficient": 0.01},
    "Momentum": {
        "alpha": 0.9,
        "beta": 0.1,
        "mode": "nesterov",
        "norm_coefficient": 0.01,
    },
    "Adam": {"norm_coefficient": 0.01, "norm_coefficient_post": 0.02},
}
INIT = Uniform(-0.05, 0.05, seed=7)
HUGE = [2**62 + 12345, -(2**63), 2**63 - 1, 2**53 + 1, -1, 0, 5]


# -- the initializer, exactly as documented ------------------------------------------
M64 = 2**64 - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _fnv(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def _word(seed: int, table: str, i: int, n: int) -> int:
    key = _splitmix(seed ^ _fnv(table.encode()))
    return _splitmix((_splitmix(key ^ (i & M64)) + n) & M64)


def _unit(w: int) -> float:
    return (w >> 11) * 2.0**-53


def test_uniform_rows_follow_the_documented_function() -> None:
    got = initial_rows(INIT, "emb", np.array(HUGE, np.int64), 5, np.float64)
    for r, i in enumerate(HUGE):
        want = [-0.05 + 0.1 * _unit(_word(7, "emb", i, j)) for j in range(5)]
        assert got[r].tolist() == want
    assert np.all((got >= -0.05) & (got < 0.05))


@pytest.mark.parametrize("truncated", [False, True])
def test_normal_rows_follow_the_documented_function(truncated: bool) -> None:
    init = Normal(0.5, 2.0, seed=3, truncated=truncated)
    ids = np.array(HUGE, np.int64)
    got = initial_rows(init, "t", ids, 4, np.float64)
    for r, i in enumerate(HUGE):
        for j in range(4):
            k = 0
            while True:
                u1 = 1.0 - _unit(_word(3, "t", i, 2 * (k * 4 + j)))
                u2 = _unit(_word(3, "t", i, 2 * (k * 4 + j) + 1))
                z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
                if not truncated or abs(z) <= 2.0:
                    break
                k += 1
            assert got[r, j] == pytest.approx(0.5 + 2.0 * z, rel=1e-12)
    if truncated:
        big = initial_rows(init, "t", np.arange(2000, dtype=np.int64), 8, np.float64)
        assert np.abs(big - 0.5).max() <= 4.0


def test_initial_rows_depend_on_seed_table_and_id_only() -> None:
    ids = np.array([3, 9, 3], np.int64)
    a = initial_rows(INIT, "emb", ids, 4, np.float32)
    assert a[0].tobytes() == a[2].tobytes()
    assert a[0].tobytes() != a[1].tobytes()
    assert a.tobytes() == initial_rows(INIT, "emb", ids, 4, np.float32).tobytes()
    assert a.tobytes() != initial_rows(INIT, "emb2", ids, 4, np.float32).tobytes()
    other = Uniform(-0.05, 0.05, seed=8)
    assert a.tobytes() != initial_rows(other, "emb", ids, 4, np.float32).tobytes()
    assert not initial_rows(Zeros(), "emb", ids, 4, np.float32).any()


# -- the store: semantics against a fixed-table reference ------------------------------
def _reference(
    op: str, universe: Array, dim: int, dtype: Any, init: Any = INIT
) -> ParameterStore:
    """A fixed table of the initial rows of ``universe`` (sorted unique ids)."""
    s = ParameterStore()
    x = initial_rows(init, "emb", universe, dim, dtype)
    s.create_group(
        "g", make_attrs(op, ATTRS[op]), 0.05, [("emb", x), ("b", np.zeros(3, dtype))]
    )
    return s


def _ids_store(op: str, dim: int, dtype: Any, **kw: Any) -> ParameterStore:
    from onnxps.wire.image import TableDefinition

    s = ParameterStore(kw.pop("limits", None))
    t = TableDefinition("emb", dim, kw.pop("init", INIT).to_json(), **kw)
    s.create_group(
        "g", make_attrs(op, ATTRS[op]), 0.05, [("b", np.zeros(3, dtype))], tables=[t]
    )
    return s


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["Adagrad", "Momentum", "Adam"])
def test_new_and_old_ids_step_as_a_fixed_table(op: str, dtype: Any) -> None:
    rng = np.random.default_rng(1)
    universe = np.unique(np.array(HUGE + list(rng.integers(-(2**63), 2**63 - 1, 40))))
    ref = _reference(op, universe, 6, dtype)
    ids = _ids_store(op, 6, dtype)
    for _ in range(5):
        pick = rng.choice(universe, 30)  # repeats, new and old ids
        g = rng.standard_normal((30, 6)).astype(dtype)
        pos = np.searchsorted(universe, pick)
        ref.push_rows("g", {"emb": (pos, g)})
        ids.push_rows("g", {"emb": (pick, g)})
    touched = ids.list_rows("g", "emb", with_values=True, with_state=True)
    pos = np.searchsorted(universe, touched.ids)
    want = ref.pull_rows("g", {"emb": pos}, with_state=True).arrays
    assert len(touched.rows) == len(want)
    for a, b in zip(touched.rows, want, strict=True):
        assert a.tobytes() == b.tobytes()
    assert ids.describe("g").update_count == ref.describe("g").update_count == 5


def test_pull_of_unknown_ids_reads_initial_rows_and_creates_none() -> None:
    s = _ids_store("Adam", 4, np.float32)
    ids = np.array([7, -7, 7], np.int64)
    out = s.pull_rows("g", {"emb": ids}, with_state=True)
    assert out.names == ("emb", "V:emb", "H:emb")
    assert (
        out.arrays[0].tobytes()
        == initial_rows(INIT, "emb", ids, 4, np.float32).tobytes()
    )
    assert not out.arrays[1].any() and not out.arrays[2].any()
    assert s.describe("g").tables[0].row_count == 0
    assert s.list_rows("g", "emb").ids.size == 0


def test_empty_push_advances_t_and_creates_nothing() -> None:
    s = _ids_store("Adam", 4, np.float32)
    out = s.push_rows(
        "g", {"emb": (np.empty(0, np.int64), np.empty((0, 4), np.float32))}
    )
    assert out.update_count == 1
    assert s.describe("g").tables[0].row_count == 0
    assert s.push_rows("g", {}).update_count == 2


def _snapshot(s: ParameterStore) -> list[bytes]:
    page = s.list_rows("g", "emb", with_values=True, with_state=True)
    return [page.ids.tobytes(), *(a.tobytes() for a in page.rows)] + [
        bytes(str(s.describe("g").update_count), "ascii")
    ]


# Below, the store is given ids as lists: it takes any array-like (ParameterStore's
# annotation says ndarray), hence the type: ignore[dict-item].


def test_max_rows_refuses_a_push_that_would_overflow_with_state_unchanged() -> None:
    s = _ids_store("Adam", 4, np.float32, max_rows=5)
    s.push_rows("g", {"emb": ([1, 2, 3], np.ones((3, 4), np.float32))})  # type: ignore[dict-item]
    before = _snapshot(s)
    from onnxps.server.errors import ResourceExhausted

    with pytest.raises(
        ResourceExhausted, match=r"create 3 rows .* holds 3 of its max_rows=5"
    ):
        s.push_rows("g", {"emb": ([3, 4, 5, 6, 4], np.ones((5, 4), np.float32))})  # type: ignore[dict-item]
    assert _snapshot(s) == before
    # old ids and exactly the room left are fine
    s.push_rows("g", {"emb": ([1, 4, 5, 4], np.ones((4, 4), np.float32))})  # type: ignore[dict-item]
    assert s.describe("g").tables[0].row_count == 5


def test_server_byte_limit_refuses_new_rows_with_state_unchanged() -> None:
    from onnxps.server.errors import ResourceExhausted

    # 3 dense floats * 3 (X, V, H) = 36 bytes; a row of 4 floats with V, H = 48
    s = _ids_store(
        "Adam", 4, np.float32, limits=StoreLimits(max_group_bytes=36 + 2 * 48)
    )
    s.push_rows("g", {"emb": ([10, 11], np.ones((2, 4), np.float32))})  # type: ignore[dict-item]
    before = _snapshot(s)
    with pytest.raises(ResourceExhausted, match="over the server's limit of 132 bytes"):
        s.push_rows("g", {"emb": ([12], np.ones((1, 4), np.float32))})  # type: ignore[dict-item]
    assert _snapshot(s) == before
    s.push_rows("g", {"emb": ([11, 10], np.ones((2, 4), np.float32))})  # type: ignore[dict-item]


def test_mixing_dense_fixed_rows_and_ids_in_one_push() -> None:
    from onnxps.wire.image import TableDefinition

    dtype = np.float32
    s = ParameterStore()
    fixed = np.random.default_rng(2).standard_normal((10, 4)).astype(dtype)
    s.create_group(
        "g",
        make_attrs("Adam", {}),
        0.05,
        [("fixed", fixed), ("b", np.zeros(3, dtype))],
        tables=[TableDefinition("emb", 4, INIT.to_json())],
    )
    universe = np.array([-3, 99], np.int64)
    ref = ParameterStore()
    ref.create_group(
        "g",
        make_attrs("Adam", {}),
        0.05,
        [
            ("fixed", fixed),
            ("b", np.zeros(3, dtype)),
            ("emb", initial_rows(INIT, "emb", universe, 4, dtype)),
        ],
    )
    rng = np.random.default_rng(3)
    gf, gb, ge = (rng.standard_normal(n).astype(dtype) for n in [(2, 4), 3, (3, 4)])  # type: ignore[call-overload]
    s.push_rows("g", {"fixed": ([1, 8], gf), "b": gb, "emb": ([99, -3, 99], ge)})  # type: ignore[dict-item]
    ref.push_rows("g", {"fixed": ([1, 8], gf), "b": gb, "emb": ([1, 0, 1], ge)})  # type: ignore[dict-item]
    a = s.pull_rows("g", {"fixed": np.arange(10), "emb": universe}, with_state=True)
    b = ref.pull_rows("g", {"fixed": np.arange(10), "emb": [0, 1]}, with_state=True)  # type: ignore[dict-item]
    assert [x.tobytes() for x in a.arrays] == [x.tobytes() for x in b.arrays]
    assert s.pull("g").arrays[1].tobytes() == ref.pull("g").arrays[1].tobytes()


def test_sync_rows_are_combined_across_the_quorum() -> None:
    from onnxps.server.store import Consistency
    from onnxps.wire.image import TableDefinition

    s = ParameterStore()
    s.create_group(
        "g",
        make_attrs("Adagrad", {}),
        0.1,
        [("b", np.zeros(2, np.float32))],
        consistency=Consistency(mode="sync", sync_workers=2),
        tables=[TableDefinition("emb", 2, Zeros().to_json(), max_rows=3)],
    )
    one = np.ones((1, 2), np.float32)
    assert not s.push_rows("g", {"emb": ([5], one)}, client_id="a").applied  # type: ignore[dict-item]
    from onnxps.server.errors import ResourceExhausted

    # the step would hold 5, 6, 7, 8: over max_rows=3 with the pending push
    with pytest.raises(ResourceExhausted, match="max_rows=3"):
        s.push_rows(
            "g",
            {"emb": ([6, 7, 8], np.ones((3, 2), np.float32))},  # type: ignore[dict-item]
            client_id="b",
        )
    assert s.push("g", [np.ones(2, np.float32)], client_id="b").applied
    assert s.describe("g").tables[0].row_count == 1
    row = s.pull_rows("g", {"emb": [5]}).arrays[0]  # type: ignore[dict-item]
    # mean of 1 and (no row) 0 is 0.5: Adagrad's first step is -lr * sign
    assert row[0, 0] < 0


# -- through the server ----------------------------------------------------------------
def _create(c: Client, name: str = "g", **kw: Any) -> None:
    c.create_group(
        name,
        kw.pop("optimizer", Adam()),
        learning_rate=0.05,
        tensors=kw.pop("tensors", {"b": np.zeros(3, np.float32)}),
        tables={"emb": IdsTable(kw.pop("dim", 4), INIT, **kw)},
    )


def _table(c: Client, name: str = "g") -> list[bytes]:
    ids, rows = c.export_rows(name, "emb", state=True)
    return [ids.tobytes()] + [rows[k].tobytes() for k in sorted(rows)]


def test_server_push_pull_describe_and_errors(client: Client) -> None:
    _create(client, max_rows=100)
    ids = np.array(HUGE + HUGE[:2], np.int64)
    g = np.ones((len(ids), 4), np.float32)
    assert client.push_rows("g", {"emb": (ids, g)}).update_count == 1
    info = client.describe_group("g")
    t = info.tables["emb"]
    assert (t.dim, t.max_rows, t.row_count, t.initializer) == (4, 100, 7, INIT)
    assert client.count_rows("g", "emb") == 7
    rows = client.pull_rows("g", {"emb": ids[:2]})["emb"]
    assert rows.shape == (2, 4)
    first = initial_rows(INIT, "emb", ids[:2], 4, np.float32)
    assert np.all(rows < first)  # stepped against a positive gradient
    with pytest.raises(InvalidArgumentError, match="ids table: its gradient is"):
        client.push_rows("g", {"emb": np.ones((3, 4), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"shape \(2, 4\)"):
        client.push_rows("g", {"emb": ([1, 2], np.ones((2, 5), np.float32))})
    with pytest.raises(InvalidArgumentError, match="float32"):
        client.push_rows("g", {"emb": ([1], np.ones((1, 4), np.float64))})
    with pytest.raises(InvalidArgumentError, match="int64"):
        client.pull_rows("g", {"emb": np.array([1.0])})
    with pytest.raises(InvalidArgumentError, match="no ids table 'nope'"):
        client.list_rows("g", "nope")
    assert client.count_rows("g", "emb") == 7
    assert client.describe_group("g").update_count == 1
    with pytest.raises(InvalidArgumentError, match="unique"):
        client.create_group(
            "h",
            Adam(),
            learning_rate=0.1,
            tensors={"emb": np.zeros(2, np.float32)},
            tables={"emb": IdsTable(2)},
        )


def test_server_max_rows_is_resource_exhausted(client: Client) -> None:
    _create(client, max_rows=2)
    client.push_rows("g", {"emb": ([1], np.ones((1, 4), np.float32))})
    before = _table(client)
    with pytest.raises(ResourceExhaustedError, match="max_rows=2"):
        client.push_rows("g", {"emb": ([2, 3], np.ones((2, 4), np.float32))})
    assert _table(client) == before
    assert client.describe_group("g").update_count == 1


def test_server_list_rows_pages_in_id_order(client: Client) -> None:
    _create(client)
    ids = np.array([9, -4, 2**60, 3, -(2**62), 7, 1, 0, 8, 2], np.int64)
    client.push_rows("g", {"emb": (ids, np.ones((10, 4), np.float32))})
    seen: list[int] = []
    token, pages = "", 0
    while True:
        page = client.list_rows("g", "emb", page_token=token, page_size=3)
        assert page.row_count == 10 and page.rows == {}
        seen += page.ids.tolist()
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == sorted(ids.tolist()) and pages == 4
    page = client.list_rows("g", "emb", page_size=2, values=True, state=True)
    assert sorted(page.rows) == ["H:emb", "V:emb", "emb"]
    want = client.pull_rows("g", {"emb": page.ids}, state=True)
    assert all(page.rows[k].tobytes() == want[k].tobytes() for k in want)
    with pytest.raises(InvalidArgumentError, match="page_token"):
        client.list_rows("g", "emb", page_token="x")


def test_same_rows_on_two_servers(
    servers: Callable[..., ServerHandle], server: Any
) -> None:
    other = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    with Client(server.address) as a, Client(other.address) as b:
        ids = np.array([HUGE[0], 12, -99], np.int64)
        for c in (a, b):
            _create(c)
        assert _rows(a, ids) == _rows(b, ids)
        for c in (a, b):
            c.push_rows("g", {"emb": (ids, np.ones((3, 4), np.float32))})
        assert _table(a) == _table(b)


def _rows(c: Client, ids: Array) -> bytes:
    return c.pull_rows("g", {"emb": ids})["emb"].tobytes()


def test_export_import_round_trip(
    servers: Callable[..., ServerHandle], client: Client, server: Any, tmp_path: Path
) -> None:
    _create(client, optimizer=Momentum(0.9, 0.1), max_rows=50)
    rng = np.random.default_rng(4)
    for _ in range(3):
        ids = rng.integers(-(2**63), 2**63 - 1, 12)
        client.push_rows(
            "g", {"emb": (ids, rng.standard_normal((12, 4)).astype(np.float32))}
        )
    client.create_group(
        "only",
        Adagrad(),
        learning_rate=0.1,
        tables={"emb": IdsTable(2, Normal(0.0, 1.0, 5, True), dtype=np.float64)},
    )
    client.push_rows("only", {"emb": ([1, 2], np.ones((2, 2)))})
    before = {n: _table(client, n) for n in ("g", "only")}
    client.export(tmp_path / "e.npz")
    other = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    with Client(other.address) as c2:
        c2.import_(tmp_path / "e.npz")
        assert {n: _table(c2, n) for n in ("g", "only")} == before
        info = c2.describe_group("g")
        assert info.update_count == 3 and info.tables["emb"].max_rows == 50
        assert c2.describe_group("only").dtype == np.float64
        step = ([5, HUGE[0]], np.ones((2, 4), np.float32))
        for c in (client, c2):
            c.push_rows("g", {"emb": step})
        assert _table(c2, "g") == _table(client, "g")


def test_big_import_streams_rows(client: Client, tmp_path: Path) -> None:
    _create(client, dim=64)
    ids = np.arange(0, 20_000, dtype=np.int64) * 7919 - 10**9
    client.push_rows("g", {"emb": (ids, np.ones((ids.size, 64), np.float32))})
    before = _table(client)
    client.export(tmp_path / "e.npz")
    client.delete_group("g")
    client.import_(tmp_path / "e.npz")  # 20,000 x 64 x 3 floats: a stream
    assert _table(client) == before


def test_snapshot_restart_keeps_the_table(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    config = ServerConfig(
        address="127.0.0.1:0", durability="snapshot", data_dir=str(tmp_path)
    )
    handle = servers(config)
    with Client(handle.address) as c:
        _create(c)
        c.push_rows("g", {"emb": (HUGE, np.ones((7, 4), np.float32))})
        before = _table(c)
        c.save()
    handle.stop(grace=0)
    handle = servers(config)
    with Client(handle.address) as c:
        assert _table(c) == before
        assert (
            _rows(c, np.array([123456789], np.int64))
            == initial_rows(INIT, "emb", np.array([123456789]), 4, np.float32).tobytes()
        )


def test_async_client_rows(server: Any) -> None:
    async def run() -> tuple[int, int, list[int]]:
        async with AsyncClient(server.address) as c:
            await c.create_group(
                "a",
                Adam(),
                learning_rate=0.1,
                tensors={"b": np.zeros(1, np.float32)},
                tables={"emb": IdsTable(3)},
            )
            await c.push_rows("a", {"emb": ([4, -4, 4], np.ones((3, 3), np.float32))})
            page = await c.list_rows("a", "emb")
            return await c.count_rows("a", "emb"), page.row_count, page.ids.tolist()

    assert asyncio.run(run()) == (2, 2, [-4, 4])


# -- a real server process: kill -9 in WAL mode ----------------------------------------
SERVER = r"""
import sys, threading
from onnxps.server.app import ServerConfig, create_server
h = create_server(ServerConfig(address="127.0.0.1:0", durability="wal",
                               data_dir=sys.argv[1])).start()
print(h.port, flush=True)
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


def _stop(proc: subprocess.Popen[bytes], kill: bool) -> None:
    if kill:
        os.kill(proc.pid, signal.SIGKILL)
    else:
        proc.terminate()
    proc.wait(timeout=30)
    assert proc.stdout is not None
    proc.stdout.close()


@pytest.mark.slow
def test_kill_9_in_wal_mode_keeps_every_acknowledged_ids_push(tmp_path: Path) -> None:
    local = _ids_store("Adam", 8, np.float32)
    rng = np.random.default_rng(11)
    proc, address = _start(tmp_path / "data")
    try:
        with Client(address, timeout=30.0) as c:
            _create(c, dim=8, optimizer=Adam(**ATTRS["Adam"]))
            for _ in range(30):
                ids = rng.integers(-(2**63), 2**63 - 1, 64)
                ids[::4] = ids[0]  # repeats
                g = rng.standard_normal((64, 8)).astype(np.float32)
                c.push_rows("g", {"emb": (ids, g)})
                local.push_rows("g", {"emb": (ids, g)})
    finally:
        _stop(proc, kill=True)
    proc, address = _start(tmp_path / "data")
    try:
        with Client(address, timeout=30.0) as c:
            assert c.describe_group("g").update_count == 30
            page = local.list_rows("g", "emb", with_values=True, with_state=True)
            ids, rows = c.export_rows("g", "emb", state=True)
            assert ids.tobytes() == page.ids.tobytes()
            assert [rows[n].tobytes() for n in page.names] == [
                a.tobytes() for a in page.rows
            ]
    finally:
        _stop(proc, kill=False)


# -- four worker processes on one ids table --------------------------------------------
WORKER = r"""
import sys
import numpy as np
from onnxps.client import Client

address, worker, pushes, universe, dim, k = sys.argv[1:]
worker, pushes, universe, dim, k = map(int, (worker, pushes, universe, dim, k))
ids = np.random.default_rng(0).integers(-2**63, 2**63 - 1, universe)
with Client(address, timeout=120.0) as c:
    for p in range(pushes):
        rng = np.random.default_rng([worker, p])
        pick = ids[rng.integers(0, universe, k)]  # with repeats
        g = rng.standard_normal((k, dim)).astype(np.float32)
        t = c.push_rows("table", {"emb": (pick, g)}).update_count
        print(worker, p, t, flush=True)
"""

UNIVERSE, DIM, WORKERS, PUSHES, PUSH_IDS = 50_000, 16, 4, 8, 1024


@pytest.mark.slow
def test_four_worker_processes_equal_a_serial_replay_in_server_order(
    server: Any,
) -> None:
    with Client(server.address, timeout=120.0) as c:
        _create(c, name="table", dim=DIM, optimizer=Adam(**ATTRS["Adam"]))
        args = [str(a) for a in (UNIVERSE, DIM, PUSH_IDS)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, server.address, str(w), str(PUSHES)]
                + args,
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
        ids = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, UNIVERSE)
        universe = np.unique(ids)
        ref = _reference("Adam", universe, DIM, np.float32)
        for t in sorted(order):
            rng = np.random.default_rng(list(order[t]))
            pick = ids[rng.integers(0, UNIVERSE, PUSH_IDS)]
            g = rng.standard_normal((PUSH_IDS, DIM)).astype(np.float32)
            ref.push_rows("g", {"emb": (np.searchsorted(universe, pick), g)})
        got_ids, got = c.export_rows("table", "emb", state=True)
        want = ref.pull_rows(
            "g", {"emb": np.searchsorted(universe, got_ids)}, with_state=True
        )
        assert c.count_rows("table", "emb") == got_ids.size > 20_000
        for name, a in zip(("emb", "V:emb", "H:emb"), want.arrays, strict=True):
            assert got[name].tobytes() == a.tobytes()


def test_sync_group_through_the_server(server: Any) -> None:
    with Client(server.address) as a, Client(server.address) as b:
        a.create_group(
            "s",
            Adagrad(),
            learning_rate=0.1,
            tensors={"b": np.zeros(2, np.float32)},
            tables={"emb": IdsTable(2)},
            consistency=Sync(workers=2),
        )
        assert not a.push_rows(
            "s", {"emb": ([1, 2], np.ones((2, 2), np.float32))}
        ).applied
        assert b.push_rows("s", {"emb": ([2], np.ones((1, 2), np.float32))}).applied
        rows = a.pull_rows("s", {"emb": [1, 2, 3]}, state=True)
        # H = mean gradient squared: id 1 got (1 + 0) / 2, id 2 got (1 + 1) / 2
        assert rows["H:emb"].tolist() == [[0.25, 0.25], [1.0, 1.0], [0.0, 0.0]]
        assert a.count_rows("s", "emb") == 2


# -- a cluster of shard processes ------------------------------------------------------
@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    from _cluster import shards

    with shards(tmp_path, 3) as (addresses, _):
        yield addresses


def _parts_t(c: Client, name: str = "g") -> list[int]:
    return [p.update_count for p in c.describe_group(name).parts]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cluster_splits_an_ids_table_by_id_hash(
    servers: Callable[..., ServerHandle], cluster: list[str], tmp_path: Path, dtype: Any
) -> None:
    """Adam and Momentum depend on T: every part steps T on every push (no rows
    for the parts owning none of its ids), so the cluster equals one server, bit
    for bit, and all parts have one T."""
    from onnxps.client._ids_cluster import owners

    one = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    with Client(cluster, timeout=30.0) as c, Client(one.address) as s:
        for cl in (c, s):
            _create(cl, dim=4, max_rows=1000, tensors={}, dtype=dtype)
            _create(
                cl,
                "m",
                dim=4,
                optimizer=Momentum(0.9, 0.5),
                tensors={},
                dtype=dtype,
            )
        with pytest.raises(ValueError, match="holds ids tables only"):
            _create(c, name="mixed", dim=4)
        info = c.describe_group("g")
        assert [p.name for p in info.parts] == [f"g#p{k}of3" for k in range(3)]
        rng = np.random.default_rng(6)
        universe = rng.integers(-(2**63), 2**63 - 1, 200)
        mine = universe[owners(universe, 3) == 1][:3]  # ids of part 1 only
        pushes: list[dict[str, Any]] = []
        for _ in range(4):
            ids = universe[rng.integers(0, 200, 64)]  # with repeats
            pushes.append({"emb": (ids, rng.standard_normal((64, 4)).astype(dtype))})
        pushes.insert(2, {"emb": (mine, np.ones((3, 4), dtype))})
        pushes.insert(3, {})  # no ids: T advances
        for k, grads in enumerate(pushes):
            for name in ("g", "m"):
                got = c.push_rows(name, grads)
                want = s.push_rows(name, grads)
                assert got.update_count == want.update_count == k + 1
                assert got.applied and not got.duplicate
                assert _parts_t(c, name) == [k + 1] * 3
        for name in ("g", "m"):
            assert _table(c, name) == _table(s, name)
            assert c.count_rows(name, "emb") == s.count_rows(name, "emb")
        probe = np.concatenate([universe[:50], [1, 2, 3]])
        a = c.pull_rows("g", {"emb": probe}, state=True)
        b = s.pull_rows("g", {"emb": probe}, state=True)
        assert list(a) == list(b) == ["emb", "V:emb", "H:emb"]
        assert all(a[k].tobytes() == b[k].tobytes() for k in b)
        assert a["emb"].dtype == dtype
        # each part holds exactly the ids it owns
        for k, part in enumerate(info.parts):
            with Client(cluster[part.shard]) as direct:
                ids, _ = direct.export_rows(part.name, "emb")
                assert ids.size and bool(np.all(owners(ids, 3) == k))
        # rows in an encoding: split after rounding, as one server rounds them
        enc = {"emb": (universe[:40], rng.standard_normal((40, 4)).astype(dtype))}
        for cl in (c, s):
            cl.push_rows("g", enc, encoding="bfloat16")
        assert _table(c) == _table(s)
        # refused whole, before any part is sent: no part steps
        bad = np.ones((3, 4), dtype)
        bad[2, 1] = np.nan
        with pytest.raises(InvalidArgumentError, match="NaN or inf"):
            c.push_rows("g", {"emb": (mine, bad)})
        with pytest.raises(InvalidArgumentError, match="one row per id"):
            c.push_rows("g", {"emb": (mine, bad[:2])})
        assert _parts_t(c) == [len(pushes) + 1] * 3
        # pages across the parts, ascending
        seen, token = [], ""
        while True:
            page = c.list_rows("g", "emb", page_token=token, page_size=17)
            seen += page.ids.tolist()
            token = page.next_page_token
            if not token:
                break
        assert seen == sorted(seen) and len(seen) == c.count_rows("g", "emb")
        assert c.delete_group("m")
        c.export(tmp_path / "c.npz")
        want_table = _table(c)
        c.delete_group("g")
        c.import_(tmp_path / "c.npz")
        assert _table(c) == want_table


@pytest.mark.slow
def test_an_ids_part_that_missed_pushes_is_sent_them_once(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    """A shard killed and restarted (WAL) while a worker pushes to an ids table:
    a push that timed out on the missing part is sent to it first by the next push
    (same seq), pushes in flight are resent until they land, a part that had taken
    one answers the resend as a duplicate; so every part ends at one T, the number
    of pushes, and the rows equal one server's that took each push once."""
    from _cluster import shards
    from _procs import start_server
    from onnxps.client import DeadlineExceededError, UnavailableError

    wal = ("--durability", "wal", "--data-dir", f"{tmp_path / 'data'}{{i}}")
    rng = np.random.default_rng(12)
    universe = rng.integers(-(2**63), 2**63 - 1, 300)
    pushes = [
        {"emb": (universe[rng.integers(0, 300, 32)], rng.standard_normal((32, 4)))}
        for _ in range(120)
    ]
    with shards(tmp_path, 3, *wal) as (addresses, procs):

        def kill(i: int) -> None:
            procs[i].send_signal(signal.SIGKILL)
            procs[i].wait()

        def start(i: int, log: str) -> None:
            procs[i], _ = start_server(
                tmp_path / log,
                "--shard",
                f"{i}/3",
                "--address",
                addresses[i],
                *(a.replace("{i}", str(i)) for a in wal),
            )

        with Client(addresses, timeout=60.0) as c:
            _create(c, dim=4, tensors={}, dtype=np.float64)
            assert c.push_rows("g", pushes[0]).update_count == 1
            down = c.describe_group("g").parts[1].shard
            kill(down)
            with pytest.raises((DeadlineExceededError, UnavailableError)):
                c.push_rows("g", pushes[1], timeout=1.5)
            for i in (i for i in range(3) if i != down):
                with Client(addresses[i]) as direct:
                    assert [g.update_count for g in direct.list_groups("g#")] == [2]
            start(down, "again.log")
            assert c.push_rows("g", pushes[2]).update_count == 3
            assert _parts_t(c) == [3] * 3
            # a worker pushing while the shard is killed and restarted under it
            results: list[Any] = []
            worker = threading.Thread(
                target=lambda: results.extend(c.push_rows("g", p) for p in pushes[3:])
            )
            worker.start()
            with Client(addresses[down]) as direct:
                for _ in range(6000):  # until the worker's pushes reach the shard
                    if direct.list_groups("g#")[0].update_count >= 8:
                        break
                    time.sleep(0.005)
            kill(down)
            start(down, "again2.log")
            worker.join()
            assert len(results) == len(pushes) - 3
            assert _parts_t(c) == [len(pushes)] * 3
            got = _table(c)
            rows = c.pull_rows("g", {"emb": universe}, state=True)
    one = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    with Client(one.address) as ref:
        _create(ref, dim=4, tensors={}, dtype=np.float64)
        for p in pushes:
            ref.push_rows("g", p)
        assert got == _table(ref)
        want = ref.pull_rows("g", {"emb": universe}, state=True)
        assert all(rows[k].tobytes() == want[k].tobytes() for k in want)


def test_the_index_finds_every_row_across_rebuilds() -> None:
    from onnxps.server.store._ids import IdsTable as Storage
    from onnxps.wire.image import TableDefinition

    t = Storage(TableDefinition("emb", 2, Zeros().to_json()), np.dtype(np.float32), ())
    rng = np.random.default_rng(9)
    held: dict[int, int] = {}
    for size in (5, 2000, 3, 700, 1500, 1, 40):  # some rebuild the index, some not
        new = np.unique(rng.integers(-(2**63), 2**63 - 1, size))
        new = new[[i not in held for i in new.tolist()]]
        slots = t.ensure(new)
        held.update(zip(new.tolist(), slots.tolist(), strict=True))
        probe = np.array([*held, 17, -17], np.int64)
        want = [*held.values(), -1, -1]
        assert t.lookup(probe).tolist() == want
    assert t.count == len(held) == len(set(held.values()))
    assert t._ids[t.sorted_slots()].tolist() == sorted(held)
