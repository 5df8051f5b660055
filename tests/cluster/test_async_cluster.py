"""AsyncClient on a cluster of shard processes: the routing of Client, run as tasks.

Both clients run one implementation of the routing (``_routes.Cluster`` and
its operations), so the same calls through either end bit-identical; cancelling a
task cancels the RPC of every shard it waits on. (An AsyncClient worker riding
through a shard's kill -9: ``test_cluster.test_kill_9_...[AsyncClient]``.)
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _cluster import shards
from _procs import StartServer, start_server, stop
from _servers import _Awaiting, _flat
from onnxps.client import (
    Adam,
    AlreadyExistsError,
    AsyncClient,
    Client,
    FailedPreconditionError,
    IdsTable,
    InvalidArgumentError,
    Momentum,
    NotFoundError,
    OptimizerSpec,
    RpcError,
)
from prometheus_client.parser import text_string_to_metric_families

SPLIT = 1000  # bytes: the big test groups are split in 3 parts
SHAPES = ((90, 6), (40,), (3,))  # 583 elements
GROUPS: dict[str, tuple[OptimizerSpec, str, bool]] = {  # optimizer, dtype, split
    "split-adam-f32": (Adam(norm_coefficient=0.01), "float32", True),
    "split-mom-f64": (Momentum(alpha=0.9, beta=0.5), "float64", True),
    "whole-mom-f32": (Momentum(alpha=0.9, beta=1.0, mode="nesterov"), "float32", False),
    "whole-adam-f64": (Adam(), "float64", False),
}


def _error(exc: RpcError) -> tuple[str, str | None, str, dict[str, str]]:
    return type(exc).__name__, exc.reason, str(exc), dict(exc.metadata)


async def _dense(ps: Any, tmp: Path) -> list[Any]:
    """Every dense call on a split and an unsplit group of each kind."""
    seen: list[Any] = []
    for name, (opt, dtype, split) in GROUPS.items():
        rng = np.random.default_rng([len(name), 3])
        shapes = SHAPES if split else ((4, 3), (5,))
        x0 = [rng.standard_normal(s).astype(dtype) for s in shapes]
        grads = [
            [rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(5)
        ]
        info = await ps.create_group(
            name,
            opt,
            learning_rate=0.1,
            tensors=[(f"x{i}", a) for i, a in enumerate(x0)],
        )
        seen.append([info.name, info.element_count, len(info.parts)])
        assert len(info.parts) == (3 if split else 1)
        seen.append(await ps.push(name, *grads[0]))
        seen.append(_flat(await ps.push(name, *grads[1], return_values=True)))
        seen.append((await ps.set_learning_rate(name, 0.05)).learning_rate)
        pushed = await ps.push_detailed(
            name, *grads[2], base_version=2, learning_rate=0.02, return_values=True
        )
        seen.append(_flat(pushed))
        seen.append(_flat(await ps.push(name, *grads[3], encoding="bfloat16")))
        t, state = await ps.pull_versioned(name, state=True)
        seen.append([t, _flat(state)])
        seen.append(_flat(await ps.pull(name, min_version=t, encoding="float16")))
        info = await ps.describe_group(name)
        seen.append([info.update_count, [p.update_count for p in info.parts]])
        with pytest.raises(InvalidArgumentError) as bad:
            await ps.push(name, *grads[4][::-1])
        seen.append(_error(bad.value))
        with pytest.raises(AlreadyExistsError) as twice:
            await ps.create_group(name, opt, learning_rate=0.1, tensors={"w": x0[1]})
        seen.append(_error(twice.value))
        lease = await ps.join(name, worker_id="w1")
        seen.append(
            [lease.live_workers, (await ps.leave(name, worker_id="w1")).live_workers]
        )
    seen.append([g.name for g in await ps.list_groups()])
    seen.append(sorted(await ps.export(tmp / f"{type(ps).__name__}.npz")))
    seen.append((await ps.delete_group("whole-adam-f64"), await ps.list_groups("wh")))
    with pytest.raises(NotFoundError) as gone:
        await ps.pull("whole-adam-f64")
    seen.append(_error(gone.value))
    seen.append(
        sorted(await ps.import_(tmp / f"{type(ps).__name__}.npz", existing="skip"))
    )
    seen.append(_flat(await ps.pull("whole-adam-f64", state=True)))
    for name in GROUPS:
        seen.append(await ps.delete_group(name))
    return seen


async def _rows(ps: Any) -> list[Any]:
    """Row pushes and pulls on a table split by rows and on an ids table."""
    seen: list[Any] = []
    for dtype in ("float32", "float64"):
        rng = np.random.default_rng(5)
        table, ids = f"rows-{dtype}", f"ids-{dtype}"
        emb = rng.standard_normal((60, 5)).astype(dtype)
        info = await ps.create_group(
            table, Adam(), learning_rate=0.1, tensors={"emb": emb, "b": emb[0]}
        )
        seen.append([p.name for p in info.parts])
        info = await ps.create_group(
            ids,
            Momentum(alpha=0.9, beta=0.5),
            learning_rate=0.1,
            tables={"e": IdsTable(3, dtype=dtype)},
        )
        seen.append([p.name for p in info.parts])
        for k in range(3):
            idx = rng.integers(0, 60, 12)  # repeats, every part
            rows = rng.standard_normal((12, 5)).astype(dtype)
            pushed = await ps.push_rows(table, {"emb": (idx, rows)}, base_version=k)
            seen.append(_flat(pushed))
            keys = rng.integers(-(2**40), 2**40, 20)
            pushed = await ps.push_rows(
                ids, {"e": (keys, rng.standard_normal((20, 3)).astype(dtype))}
            )
            seen.append(_flat(pushed))
        got = await ps.pull_rows(table, {"emb": [59, 0, 31, 0]}, state=True)
        seen.append({k: _flat(v) for k, v in sorted(got.items())})
        seen.append(_flat(await ps.pull(table, state=True)))
        all_ids, all_rows = await ps.export_rows(ids, "e", state=True)
        seen.append([_flat(all_ids), {k: _flat(v) for k, v in all_rows.items()}])
        got = await ps.pull_rows(ids, {"e": all_ids[::-3]}, state=True)
        seen.append({k: _flat(v) for k, v in sorted(got.items())})
        page = await ps.list_rows(ids, "e", page_size=7, values=True)
        seen.append([_flat(page.ids), page.next_page_token, page.row_count])
        seen.append(await ps.count_rows(ids, "e"))
        with pytest.raises(InvalidArgumentError) as bad:
            await ps.pull_rows(table, {"emb": [60]})
        seen.append(_error(bad.value))
        with pytest.raises(InvalidArgumentError) as bad:
            await ps.list_rows(table, "emb")
        seen.append(_error(bad.value))
    return seen


@pytest.mark.slow
def test_client_and_async_client_end_bit_identical_on_a_cluster(
    tmp_path: Path,
) -> None:
    """The same sequence through Client, then (the groups deleted) AsyncClient:
    the same results, errors and final state, bit for bit."""
    settings: dict[str, Any] = {"timeout": 30, "split_bytes": SPLIT}

    async def run(addresses: list[str]) -> tuple[list[Any], list[Any]]:
        with Client(addresses, **settings) as c:
            blocking = await _dense(_Awaiting(c), tmp_path)
            blocking += await _rows(_Awaiting(c))
            for g in await _Awaiting(c).list_groups():
                assert await _Awaiting(c).delete_group(g.name)
        async with AsyncClient(addresses, **settings) as ac:
            awaited = await _dense(ac, tmp_path)
            awaited += await _rows(ac)
        return blocking, awaited

    with shards(tmp_path, 3) as (addresses, _):
        blocking, awaited = asyncio.run(run(addresses))
    assert awaited == blocking
    assert blocking[0] == ["split-adam-f32", 583, 3]
    assert blocking[6][0] == 4  # T of split-adam-f32 after four pushes


async def _until(check: Any, seconds: float = 20.0) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds
        await asyncio.sleep(0.02)


def _waiting(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return next(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "onnxps_waiting_calls"
    )


@pytest.mark.slow
def test_a_cancelled_pull_frees_the_wait_on_every_shard(tmp_path: Path) -> None:
    x = np.zeros((30, 20), np.float32)  # 2400 bytes: one part on each shard

    async def run(addresses: list[str], urls: list[str]) -> None:
        async with AsyncClient(addresses, timeout=60, split_bytes=SPLIT) as ps:
            info = await ps.create_group(
                "g", Adam(), learning_rate=0.1, tensors={"x": x}
            )
            assert sorted(p.shard for p in info.parts) == [0, 1, 2]
            waiting = asyncio.create_task(ps.pull("g", min_version=5))
            await _until(lambda: all(_waiting(u) == 1 for u in urls))
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await _until(lambda: all(_waiting(u) == 0 for u in urls))
            assert await ps.push("g", np.ones_like(x), timeout=10) == 1
            parts = (await ps.describe_group("g")).parts
            assert [p.update_count for p in parts] == [1, 1, 1]

    with shards(tmp_path, 3, "--metrics-port", "0") as (addresses, _):
        urls = []
        for i in range(3):
            log = (tmp_path / f"s{i}.log").read_text()
            found = re.search(r"metrics on (http://\S+/metrics)", log)
            assert found, log
            urls.append(found.group(1))
        asyncio.run(run(addresses, urls))


@pytest.mark.slow
def test_a_push_cancelled_while_a_part_hangs_is_completed_by_the_next(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    """A shard stops answering (SIGSTOP) while a push travels: the task is
    cancelled after the other parts took it. The shard is killed and restarted
    from its WAL (without the push); the next push sends the cancelled one's parts
    first (same seq: the parts that took it answer a duplicate), so every part
    ends at T=2 with the values of one server that took both pushes."""
    wal = ("--durability", "wal", "--data-dir", f"{tmp_path / 'data'}{{i}}")
    rng = np.random.default_rng(21)
    x0 = [
        (f"x{i}", rng.standard_normal(s).astype(np.float32))
        for i, s in enumerate(SHAPES)
    ]
    grads = [
        [rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(2)
    ]

    async def run(addresses: list[str], procs: list[Any]) -> list[np.ndarray]:
        async with AsyncClient(addresses, timeout=30, split_bytes=SPLIT) as ps:
            info = await ps.create_group("c", Adam(), learning_rate=0.05, tensors=x0)
            stuck = info.parts[1].shard
            live = [Client(addresses[p.shard]) for p in info.parts if p.shard != stuck]

            def taken() -> bool:
                return all(c.list_groups("c#")[0].update_count == 1 for c in live)

            procs[stuck].send_signal(signal.SIGSTOP)
            try:
                pushing = asyncio.create_task(ps.push("c", *grads[0]))
                await _until(taken)
                pushing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pushing
            finally:
                stop(procs[stuck])  # SIGKILL: it never read the push
            procs[stuck], _ = start_server(
                tmp_path / "again.log",
                "--shard",
                f"{stuck}/3",
                "--address",
                addresses[stuck],
                *(a.replace("{i}", str(stuck)) for a in wal),
            )
            for c in live:
                c.close()
            assert await ps.push("c", *grads[1]) == 2
            parts = (await ps.describe_group("c")).parts
            assert [p.update_count for p in parts] == [2, 2, 2]
            saved = await ps.save()  # every shard writes a snapshot
            paths = saved.path.split(", ")
            assert len(paths) == 3 and saved.groups == 3
            assert all(
                p.startswith(f"{tmp_path / 'data'}{i}") for i, p in enumerate(paths)
            )
            pulled: list[np.ndarray] = await ps.pull("c", state=True)
            return pulled

    with shards(tmp_path, 3, *wal) as (addresses, procs):
        got = asyncio.run(run(addresses, procs))
    ref_server, one_address = server_processes(tmp_path / "ref.log")
    with Client(one_address) as ref:
        ref.create_group("c", Adam(), learning_rate=0.05, tensors=x0)
        for g in grads:
            ref.push("c", *g)
        want = ref.pull("c", state=True)
    for got_a, want_a in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_a, want_a, strict=True)


@pytest.mark.slow
def test_a_wrong_shard_count_is_refused_as_client_refuses_it(tmp_path: Path) -> None:
    async def refusal(addresses: list[str]) -> FailedPreconditionError:
        async with AsyncClient(addresses, timeout=10) as ps:
            with pytest.raises(FailedPreconditionError) as err:
                await ps.pull("small")
            return err.value

    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30) as ps:
            ps.create_group("small", Adam(), learning_rate=0.1, tensors={"w": [1.0]})
        with Client(addresses[:2], timeout=10) as two:
            with pytest.raises(FailedPreconditionError) as err:
                two.pull("small")
        got = asyncio.run(refusal(addresses[:2]))
    assert _error(got) == _error(err.value)
    assert got.reason == "SHARD_LAYOUT_MISMATCH"
    assert got.metadata == {"routed": "0/2", "shard": "0/3"}
    assert "this is shard 0 of 3; the client routed for 2 shards" in str(got)


def test_async_client_takes_a_list_of_shard_addresses() -> None:
    ac = AsyncClient(["127.0.0.1:1", "127.0.0.1:2"])  # nothing is opened yet
    assert (ac.shards, ac.address) == (2, "127.0.0.1:1,127.0.0.1:2")
    one = AsyncClient("127.0.0.1:1")
    assert one.shards is None and one.addresses == ["127.0.0.1:1"]
    with pytest.raises(TypeError, match="a cluster's shards as a list of them"):
        AsyncClient(["127.0.0.1:1", ""])
