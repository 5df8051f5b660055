"""Embedding-table benchmark: row pushes and pulls on a 1M x 64 float32 Adam table.

    python benchmarks/embeddings.py [--rows 1000000] [--dim 64] [--batch 4096]

Figures, each beside a baseline measured in the same run:

- through a server process (``onnxps serve`` with no flag but a free loopback port, and
  ``Client(address)``: what a user gets with no flags): ``push_rows`` of ``--batch``
  random rows (drawn with repeats) and ``pull_rows`` of as many: p50/p99 latency and
  rows/s; baseline: the same update as a dense push of the whole table (``push``).
- in this process, the server-side step alone (``ParameterStore.push_rows``: coalesce,
  gather, ONNX step, scatter) beside ``torch.optim.SparseAdam`` on a local
  ``torch.nn.Embedding(sparse=True)`` with the same indices (``optimizer.step()``
  alone, and with the backward pass that builds its sparse gradient), when torch is
  installed.

- with ``--cluster``: the table split by rows over 2 shard processes (``onnxps serve
  --shard I/2 --durability none``; ``Client`` of a list of shards): ``push_rows`` of
  random rows (both parts own some), of rows of part 0 only (part 1 gets the push with
  no rows, which keeps its T with part 0's), an empty row push alone (what a part that
  owns no row costs), and ``pull_rows``.
- an ids table (``--ids``, default 1,000,000 distinct random int64 ids, 0: skip):
  through a server process, the table is filled by pushes of 65,536 new ids (rows
  created/s), then ``push_rows`` of ``--batch`` ids drawn with repeats from those ids
  and ``pull_rows`` of as many (p50/p99, rows/s); and the server-side step alone in
  this process on a table of the same ids.

The machine may be shared: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import (
    start_default_server,
    start_server_process,
    stop_processes,
)
from onnxps.client import Adam, Client, IdsTable, Uniform
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore
from onnxps.wire.image import TableDefinition


def _times(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _pct(ts: list[float], q: float) -> float:
    s = sorted(ts)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def _line(what: str, ts: list[float], rows: int) -> None:
    rate = f"  {rows / statistics.median(ts):12,.0f} rows/s" if rows else ""
    print(f"{what:<44} p50 {_pct(ts, 0.5):9.2f} ms  p99 {_pct(ts, 0.99):9.2f} ms{rate}")


def _batches(rows: int, dim: int, batch: int, n: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.integers(0, rows, batch),  # with repeats
            rng.standard_normal((batch, dim)).astype(np.float32),
        )
        for _ in range(n)
    ]


def served(rows: int, dim: int, batch: int, pushes: int, dense: int) -> float:
    x = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_default_server(Path(tmp), log=Path(tmp) / "server.log")
        try:
            with Client(address, timeout=600.0) as c:
                c.create_group("emb", Adam(), learning_rate=0.01, tensors={"emb": x})
                work = _batches(rows, dim, batch, pushes)
                it = iter(work * 2)

                def push() -> None:
                    idx, g = next(it)
                    c.push_rows("emb", {"emb": (idx, g)})

                def pull() -> None:
                    c.pull_rows("emb", {"emb": work[0][0]})

                _times(push, 5)  # warm up
                push_ts = _times(push, pushes)
                pull_ts = _times(pull, pushes)
                full = np.zeros_like(x)
                idx, g = work[0]
                np.add.at(full, idx, g)

                def dense_push() -> None:
                    c.push("emb", full)

                dense_ts = _times(dense_push, dense)
        finally:
            stop_processes([proc], timeout=120)  # its snapshot on the way out
    print(
        f"\n-- through a server (no flags on either end): {rows:,} x {dim} float32 "
        f"Adam, {batch:,} rows/push"
    )
    _line(f"push_rows ({batch:,} rows, with repeats)", push_ts, batch)
    _line(f"pull_rows ({batch:,} rows)", pull_ts, batch)
    _line("dense push of the whole table (baseline)", dense_ts, rows)
    ratio = statistics.median(push_ts) / statistics.median(dense_ts)
    print(f"row push / dense push (p50): {ratio:.2%}  (aim: under 2%)")
    return ratio


def server_step(rows: int, dim: int, batch: int, n: int) -> float:
    x = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    store = ParameterStore()
    store.create_group("emb", make_attrs("Adam", {}), 0.01, [("emb", x)])
    work = _batches(rows, dim, batch, n)
    it = iter(work * 2)

    def step() -> None:
        idx, g = next(it)
        store.push_rows("emb", {"emb": (idx, g)})

    _times(step, 5)
    ts = _times(step, n)
    print(f"\n-- the step alone, in this process ({batch:,} rows)")
    _line("ParameterStore.push_rows (server-side step)", ts, batch)
    return statistics.median(ts)


def sparse_adam(rows: int, dim: int, batch: int, n: int) -> float | None:
    try:
        import torch
    except ImportError:
        print("torch is not installed: no SparseAdam baseline")
        return None
    torch.set_num_threads(1)
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    work = [
        (torch.from_numpy(i), torch.from_numpy(g))
        for i, g in _batches(rows, dim, batch, n)
    ]
    step_ts, full_ts = [], []
    for k in range(n + 5):
        idx, g = work[k % n]
        t0 = time.perf_counter()
        opt.zero_grad()
        (emb(idx) * g).sum().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if k >= 5:
            step_ts.append(t2 - t1)
            full_ts.append(t2 - t0)
    print(f"torch {torch.__version__}, 1 thread")
    _line("SparseAdam optimizer.step()", step_ts, batch)
    _line("SparseAdam backward + step", full_ts, batch)
    return statistics.median(step_ts)


def cluster(rows: int, dim: int, batch: int, pushes: int) -> None:
    x = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        procs, addresses = [], []
        try:
            for i in range(2):
                proc, address = start_server_process(
                    "--shard", f"{i}/2", log=Path(tmp) / f"shard{i}.log"
                )
                procs.append(proc)
                addresses.append(address)
            split = x.nbytes // 2
            with Client(addresses, timeout=600.0, split_bytes=split) as c:
                c.create_group("emb", Adam(), learning_rate=0.01, tensors={"emb": x})
                parts = c.describe_group("emb").parts
                first_rows = parts[0].element_count // dim
                work = _batches(rows, dim, batch, pushes)
                near = _batches(first_rows, dim, batch, pushes)
                it = iter(work * 2)
                it0 = iter(near * 2)

                def push() -> None:
                    idx, g = next(it)
                    c.push_rows("emb", {"emb": (idx, g)})

                def push_part0() -> None:
                    idx, g = next(it0)
                    c.push_rows("emb", {"emb": (idx, g)})

                def empty() -> None:
                    c.push_rows("emb", {})

                def pull() -> None:
                    c.pull_rows("emb", {"emb": work[0][0]})

                _times(push, 5)
                push_ts = _times(push, pushes)
                part0_ts = _times(push_part0, pushes)
                empty_ts = _times(empty, pushes)
                pull_ts = _times(pull, pushes)
        finally:
            stop_processes(procs)
    print(f"\n-- a cluster of 2 shards, the table split by rows ({len(parts)} parts)")
    _line(f"push_rows ({batch:,} random rows)", push_ts, batch)
    _line(f"push_rows ({batch:,} rows of part 0 only)", part0_ts, batch)
    _line("push_rows with no rows (every part steps T)", empty_ts, 0)
    _line(f"pull_rows ({batch:,} rows)", pull_ts, batch)


def _ids_batches(universe: Any, dim: int, batch: int, n: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(2)
    return [
        (
            universe[rng.integers(0, universe.size, batch)],  # with repeats
            rng.standard_normal((batch, dim)).astype(np.float32),
        )
        for _ in range(n)
    ]


def ids_table(ids: int, dim: int, batch: int, pushes: int) -> None:
    universe = np.random.default_rng(3).integers(-(2**63), 2**63 - 1, ids)
    fill = 65_536
    work = _ids_batches(universe, dim, batch, pushes)
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_default_server(Path(tmp), log=Path(tmp) / "server.log")
        try:
            with Client(address, timeout=600.0) as c:
                c.create_group(
                    "ids",
                    Adam(),
                    learning_rate=0.01,
                    tables={"emb": IdsTable(dim, Uniform(-0.05, 0.05, seed=7))},
                )
                chunks = [universe[i : i + fill] for i in range(0, ids, fill)]
                g = np.ones((fill, dim), np.float32)
                t0 = time.perf_counter()
                for chunk in chunks:
                    c.push_rows("ids", {"emb": (chunk, g[: chunk.size])})
                filled = time.perf_counter() - t0
                rows = c.count_rows("ids", "emb")
                it = iter(work * 2)

                def push() -> None:
                    i, gr = next(it)
                    c.push_rows("ids", {"emb": (i, gr)})

                def pull() -> None:
                    c.pull_rows("ids", {"emb": work[0][0]})

                _times(push, 5)
                push_ts = _times(push, pushes)
                pull_ts = _times(pull, pushes)
        finally:
            stop_processes([proc], timeout=120)  # its snapshot on the way out
    print(
        "\n-- an ids table through a server (no flags on either end): "
        f"{rows:,} random int64 ids x {dim}"
    )
    print(
        f"{'filling: pushes of 65,536 new ids':<44} {filled:9.2f} s total"
        f"  {rows / filled:12,.0f} rows created/s"
    )
    _line(f"push_rows ({batch:,} ids, with repeats)", push_ts, batch)
    _line(f"pull_rows ({batch:,} ids)", pull_ts, batch)
    store = ParameterStore()
    table = TableDefinition("emb", dim, Uniform(-0.05, 0.05, seed=7).to_json())
    store.create_group("ids", make_attrs("Adam", {}), 0.01, [], tables=[table])
    for i in range(0, ids, fill):
        chunk = universe[i : i + fill]
        store.push_rows("ids", {"emb": (chunk, np.ones((chunk.size, dim), np.float32))})
    it2 = iter(work * 2)

    def step() -> None:
        i, gr = next(it2)
        store.push_rows("ids", {"emb": (i, gr)})

    _times(step, 5)
    _line("ParameterStore.push_rows on the ids table", _times(step, pushes), batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pushes", type=int, default=100)
    p.add_argument("--dense", type=int, default=5)
    p.add_argument("--cluster", action="store_true", help="also on 2 shards")
    p.add_argument("--ids", type=int, default=1_000_000)
    p.add_argument("--only-ids", action="store_true", help="the ids table run alone")
    a = p.parse_args()
    if a.ids:
        ids_table(a.ids, a.dim, a.batch, a.pushes)
    if a.only_ids:
        return
    served(a.rows, a.dim, a.batch, a.pushes, a.dense)
    ours = server_step(a.rows, a.dim, a.batch, a.pushes)
    theirs = sparse_adam(a.rows, a.dim, a.batch, a.pushes)
    if theirs:
        ratio = ours / theirs
        print(f"server-side step / SparseAdam step (p50): {ratio:.2f}x  (aim: <= 2x)")
    if a.cluster:
        cluster(a.rows, a.dim, a.batch, a.pushes)


if __name__ == "__main__":
    main()
