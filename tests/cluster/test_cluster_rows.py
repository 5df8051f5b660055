"""A table split by rows across shard processes: layouts, row pushes and pulls.

Every shard is ``onnxps serve --shard I/N`` in its own process; each test compares
the split group with the same calls on one unsplit server, bit for bit.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from _cluster import OPTIMIZERS, shards
from _procs import StartServer, start_server, stop
from onnxps.client import (
    Adam,
    Client,
    DeadlineExceededError,
    Encoding,
    EncodingRangeError,
    FailedPreconditionError,
    InvalidArgumentError,
    OptimizerSpec,
    Sync,
    UnavailableError,
    shard_ranking,
)
from onnxps.client._cluster import (
    Slot,
    join_arrays,
    layout_from_listing,
    part_arrays,
    plan_layout,
)

ROWS, DIM = 90, 6
SPLIT = 1000  # bytes: the test groups are split in 3 parts


def _tensors(dtype: Any, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 7])
    return {
        "emb": rng.standard_normal((ROWS, DIM)).astype(dtype),
        "w": rng.standard_normal(40).astype(dtype),
        "b": rng.standard_normal(3).astype(dtype),
    }


def _create(ps: Client, name: str, opt: OptimizerSpec, dtype: Any, **kw: Any) -> None:
    ps.create_group(
        name, opt, learning_rate=0.05, tensors=_tensors(dtype, len(name)), **kw
    )


def _row_pushes(dtype: Any) -> list[dict[str, Any]]:
    """Row pushes that span parts, repeat rows, touch one part or none."""
    rng = np.random.default_rng(11)

    def rows(idx: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return np.array(idx, np.int64), rng.standard_normal((len(idx), DIM)).astype(
            dtype
        )

    return [
        {"emb": rows([89, 0, 45, 0, 31, 89, 0, 60])},  # every part, repeats
        {"emb": rows([2, 5, 2])},  # the first part only
        {},  # no rows: T advances
        {"emb": rows([]), "w": rng.standard_normal(40).astype(dtype)},
        {"emb": rows([70, 71, 72]), "b": rng.standard_normal(3).astype(dtype)},
    ]


def _dense(dtype: Any, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(a.shape).astype(dtype) for a in _tensors(dtype).values()
    ]


def _same(ps: Client, ref: Client, name: str) -> None:
    t, got = ps.pull_versioned(name, state=True)
    t1, want = ref.pull_versioned(name, state=True)
    assert t == t1
    assert [p.update_count for p in ps.describe_group(name).parts] == [t] * 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w, strict=True)


def test_a_table_is_cut_on_row_boundaries_and_old_layouts_still_read() -> None:
    names, shapes = ["emb", "w", "b"], [(ROWS, DIM), (40,), (3,)]
    layout = plan_layout("g", names, shapes, 4, 3, SPLIT)
    # 583 elements cut at 194 and 388: moved down to rows 32 (192) and 64 (384)
    assert layout.slot_names(layout.parts[0]) == ["emb@r0-32@90,6"]
    assert layout.slot_names(layout.parts[1]) == ["emb@r32-64@90,6"]
    assert layout.slot_names(layout.parts[2]) == [
        "emb@r64-90@90,6",
        "w@0-40@40",
        "b@0-3@3",
    ]
    assert [layout.slot_shape(s) for s in layout.parts[2].slots] == [
        (26, 6),
        (40,),
        (3,),
    ]
    arrays = list(_tensors(np.float32).values())
    pieces = [part_arrays(layout, p, arrays) for p in layout.parts]
    assert [a.shape for a in pieces[0]] == [(32, 6)]
    for got, want in zip(join_arrays(layout, pieces), arrays, strict=True):
        np.testing.assert_array_equal(got, want, strict=True)
    listing = [
        (
            p.shard,
            p.name,
            [(n, a.shape) for n, a in zip(layout.slot_names(p), pc, strict=True)],
        )
        for p, pc in zip(layout.parts, pieces, strict=True)
    ]
    assert layout_from_listing("g", listing[::-1]) == layout
    # a table of 2 rows over 3 shards: equal cuts merge, 2 parts
    two = plan_layout("t", ["e"], [(2, 300)], 4, 3, 1000)
    assert [p.name for p in two.parts] == ["t#p0of2", "t#p1of2"]
    assert [two.slot_names(p) for p in two.parts] == [
        ["e@r0-1@2,300"],
        ["e@r1-2@2,300"],
    ]
    # an older client's layout: element ranges of the 2-D table, 1-D pieces
    old = [
        (0, "g#p0of2", [("emb@0-300@90,6", (300,))]),
        (2, "g#p1of2", [("emb@300-540@90,6", (240,)), ("w@0-40@40", (40,))]),
    ]
    found = layout_from_listing("g", old)
    assert found is not None and found.shapes == ((90, 6), (40,))
    assert found.parts[1].slots == (Slot(0, 300, 540), Slot(1, 0, 40))
    flat = [np.arange(540.0).reshape(90, 6), np.arange(40.0)]
    back = join_arrays(found, [part_arrays(found, p, flat) for p in found.parts])
    for got, want in zip(back, flat, strict=True):
        np.testing.assert_array_equal(got, want, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_and_dense_pushes_on_a_split_table_equal_one_server(
    tmp_path: Path, dtype: Any
) -> None:
    """Every optimizer: dense pushes, row pushes (across parts, with repeats, on one
    part, none) and row pulls on 3 shards equal one server's, bit for bit."""
    with shards(tmp_path, 3) as (addresses, _):
        one, one_address = start_server(tmp_path / "one.log")
        try:
            with (
                Client(addresses, timeout=60, split_bytes=SPLIT) as ps,
                Client(one_address, timeout=60) as ref,
            ):
                for opt, spec in OPTIMIZERS.items():
                    _create(ps, opt, spec, dtype)
                    _create(ref, opt, spec, dtype)
                    assert len(ps.describe_group(opt).parts) == 3
                    for c in (ps, ref):
                        c.push(opt, *_dense(dtype, 1))
                    for k, grads in enumerate(_row_pushes(dtype)):
                        got = ps.push_rows(opt, grads)
                        want = ref.push_rows(opt, grads)
                        assert got.update_count == want.update_count == k + 2
                        assert got.applied and not got.duplicate
                    for c in (ps, ref):
                        c.push(opt, *_dense(dtype, 2))
                    _same(ps, ref, opt)
                    sel = {"emb": np.array([89, 3, 45, 3, 0, 64, 63]), "b": [2, 0]}
                    got_rows = ps.pull_rows(opt, sel, state=True)
                    want_rows = ref.pull_rows(opt, sel, state=True)
                    assert list(got_rows) == list(want_rows)
                    for key, w in want_rows.items():
                        np.testing.assert_array_equal(got_rows[key], w, strict=True)
                    empty = ps.pull_rows(opt, {"emb": np.array([], np.int64)})
                    assert empty["emb"].shape == (0, DIM)
                    assert empty["emb"].dtype == dtype
        finally:
            stop(one)


@pytest.mark.slow
def test_encoded_row_pushes_on_a_split_table_equal_one_server(tmp_path: Path) -> None:
    """``encoding=`` on a split table: each part gets its rows in the encoding (the
    rounding of the whole push, cut per part), as one server gets them; a value the
    encoding cannot hold is refused before any part is sent."""
    with shards(tmp_path, 3) as (addresses, _):
        one, one_address = start_server(tmp_path / "one.log")
        try:
            with (
                Client(addresses, timeout=60, split_bytes=SPLIT) as ps,
                Client(one_address, timeout=60) as ref,
                Client(addresses, timeout=60, gradient_encoding="bfloat16") as ps16,
                Client(one_address, timeout=60, gradient_encoding="bfloat16") as ref16,
            ):
                for dtype in (np.float32, np.float64):
                    name = f"enc-{np.dtype(dtype).name}"
                    _create(ps, name, Adam(), dtype)
                    _create(ref, name, Adam(), dtype)
                    assert len(ps.describe_group(name).parts) == 3
                    for k, grads in enumerate(_row_pushes(dtype)):
                        enc: Encoding = ("bfloat16", "float16")[k % 2]
                        got = ps.push_rows(name, grads, encoding=enc)
                        want = ref.push_rows(name, grads, encoding=enc)
                        assert got.update_count == want.update_count == k + 1
                    for c in (ps16, ref16):  # the client's default encoding
                        c.push_rows(name, _row_pushes(dtype)[0])
                    _same(ps, ref, name)
                    native = _row_pushes(dtype)[0]["emb"]
                    before = ps.pull(name, state=True)
                    too_big = {"emb": (native[0], np.full_like(native[1], 1e6))}
                    with pytest.raises(EncodingRangeError, match="float16"):
                        ps.push_rows(name, too_big, encoding="float16")
                    assert [p.update_count for p in ps.describe_group(name).parts] == [
                        6
                    ] * 3
                    for g, w in zip(ps.pull(name, state=True), before, strict=True):
                        np.testing.assert_array_equal(g, w, strict=True)
                    # the encoding did round: a native push gives other values
                    ps.push_rows(name, {"emb": native})
                    ref.push_rows(name, {"emb": native}, encoding="bfloat16")
                    got_rows = ps.pull_rows(name, {"emb": native[0]})["emb"]
                    want_rows = ref.pull_rows(name, {"emb": native[0]})["emb"]
                    assert got_rows.dtype == want_rows.dtype == dtype
                    assert got_rows.tobytes() != want_rows.tobytes()
        finally:
            stop(one)


@pytest.mark.slow
def test_refusals_leave_every_part_unchanged(tmp_path: Path) -> None:
    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "r", Adam(), np.float32)
            ps.push_rows("r", {"emb": (np.array([1, 50, 80]), np.ones((3, DIM), "f4"))})
            before = ps.pull("r", state=True)
            rows = np.ones((2, DIM), np.float32)
            bad: list[tuple[dict[str, Any], str]] = [
                ({"emb": (np.array([3, ROWS]), rows)}, "ROW_INDEX_OUT_OF_RANGE"),
                ({"emb": (np.array([-1, 3]), rows)}, "ROW_INDEX_OUT_OF_RANGE"),
                ({"emb": (np.array([[3, 4]]), rows)}, "ROW_INDICES"),
                ({"emb": (np.array([3, 70]), rows[:1])}, "SHAPE_MISMATCH"),
                ({"emb": (np.array([3, 70]), rows.astype("f8"))}, "DTYPE_MISMATCH"),
                ({"nope": (np.array([3]), rows[:1])}, "UNKNOWN_TENSOR"),
                ({"w": np.ones(41, np.float32)}, "SHAPE_MISMATCH"),
            ]
            nan = rows.copy()
            nan[1, 2] = np.nan  # in the last part's rows only
            bad.append(({"emb": (np.array([3, 70]), nan)}, "NON_FINITE_GRADIENT"))
            for grads, reason in bad:
                with pytest.raises(InvalidArgumentError) as err:
                    ps.push_rows("r", grads)
                assert err.value.reason == reason, grads
            with pytest.raises(InvalidArgumentError, match="out of range"):
                ps.pull_rows("r", {"emb": np.array([0, 90])})
            assert [p.update_count for p in ps.describe_group("r").parts] == [1] * 3
            for got, want in zip(ps.pull("r", state=True), before, strict=True):
                np.testing.assert_array_equal(got, want, strict=True)


@pytest.mark.slow
def test_a_part_that_missed_a_row_push_is_sent_it_again(
    server_processes: StartServer, tmp_path: Path
) -> None:
    """The shard of part 1 is down through a row push's deadline: the push fails
    having reached the other parts; the next row push sends the missing part first
    (same seq), so every part ends at the same T and one server's values."""
    data = tmp_path / "data"
    wal = ("--durability", "wal", "--data-dir", f"{data}{{i}}")
    pushes = _row_pushes(np.float32)
    with shards(tmp_path, 3, *wal) as (addresses, procs):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "late", Adam(), np.float32)
            assert ps.push_rows("late", pushes[0]).update_count == 1
            down = ps.describe_group("late").parts[1].shard
            procs[down].send_signal(signal.SIGKILL)
            procs[down].wait()
            with pytest.raises((DeadlineExceededError, UnavailableError)):
                ps.push_rows("late", pushes[1], timeout=1.5)  # rows of part 0 only
            for i in (p for p in range(3) if p != down):
                with Client(addresses[i]) as one:
                    assert [g.update_count for g in one.list_groups("late#")] == [2]
            proc, _ = start_server(
                tmp_path / "again.log",
                "--shard",
                f"{down}/3",
                "--address",
                addresses[down],
                *(a.replace("{i}", str(down)) for a in wal),
            )
            procs[down] = proc
            assert ps.push_rows("late", pushes[4]).update_count == 3
            assert [p.update_count for p in ps.describe_group("late").parts] == [3] * 3
            got = ps.pull("late", state=True)
    ref_server, one_address = server_processes(tmp_path / "ref.log")
    with Client(one_address) as ref:
        _create(ref, "late", Adam(), np.float32)
        for grads in (pushes[0], pushes[1], pushes[4]):
            ref.push_rows("late", grads)
        want = ref.pull("late", state=True)
    for got_a, want_a in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_a, want_a, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sync_row_pushes_on_a_split_table_equal_one_server(
    tmp_path: Path, reduction: Literal["mean", "sum"]
) -> None:
    """Two workers per step (client ids a, b), rows on different parts and shared."""
    rng = np.random.default_rng(5)
    steps = [
        [
            (
                np.array(idx, np.int64),
                rng.standard_normal((len(idx), DIM)).astype(np.float32),
            )
            for idx in pair
        ]
        for pair in (([1, 80, 1], [80, 40]), ([10], []), ([89, 0], [0, 89, 50]))
    ]
    with shards(tmp_path, 3) as (addresses, _):
        one, one_address = start_server(tmp_path / "one.log")
        try:
            targets: list[tuple[Any, dict[str, Any]]] = [
                (addresses, {"split_bytes": SPLIT}),
                (one_address, {}),
            ]
            results = []
            for target, kw in targets:
                workers = [
                    Client(target, timeout=30, client_id=cid, **kw) for cid in "ab"
                ]
                try:
                    sync = Sync(2, reduction=reduction)
                    _create(workers[0], "s", Adam(), np.float32, consistency=sync)
                    for pair in steps:
                        for w, grads in zip(workers, pair, strict=True):
                            w.push_rows("s", {"emb": grads})
                    results.append(workers[0].pull_versioned("s", state=True))
                    if target is addresses:
                        parts = workers[0].describe_group("s").parts
                        assert [p.update_count for p in parts] == [3] * 3
                finally:
                    for w in workers:
                        w.close()
        finally:
            stop(one)
    (t, got), (t1, want) = results
    assert t == t1 == 3
    for got_a, want_a in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_a, want_a, strict=True)


@pytest.mark.slow
def test_rows_of_a_table_split_by_element_ranges_are_refused(tmp_path: Path) -> None:
    """A layout an older client made (1-D pieces of a 2-D table): dense pushes and
    pulls work; row calls are refused, naming the way out."""
    table = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    cut = 250  # inside row 41
    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30) as ps:
            ranking = shard_ranking("old", 3)
            for k, (lo, hi) in enumerate(((0, cut), (cut, table.size))):
                with Client(addresses[ranking[k]]) as one:
                    one.create_group(
                        f"old#p{k}of2",
                        Adam(),
                        learning_rate=0.1,
                        tensors={
                            f"emb@{lo}-{hi}@{ROWS},{DIM}": table.reshape(-1)[lo:hi]
                        },
                    )
            np.testing.assert_array_equal(ps.pull("old")[0], table, strict=True)
            assert ps.push("old", np.ones_like(table)) == 1
            with pytest.raises(FailedPreconditionError) as err:
                ps.push_rows("old", {"emb": (np.array([0]), np.ones((1, DIM), "f4"))})
            assert err.value.reason == "CLUSTER_LAYOUT_NOT_BY_ROWS"
            assert "export the group and import it again" in str(err.value)
            with pytest.raises(FailedPreconditionError):
                ps.pull_rows("old", {"emb": np.array([0])})
