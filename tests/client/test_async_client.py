"""AsyncClient: the same API and results as Client; concurrency, cancellation,
deadlines; and Client.push_background."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxps.client
import pytest
from _procs import StartServer
from _servers import _Awaiting, _flat
from deadlines import resend_pauses, waited_for
from onnxps.client import (
    Adagrad,
    Adam,
    Async,
    AsyncClient,
    Client,
    ClientClosedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    Momentum,
    NotFoundError,
    OptimizerSpec,
    PushResult,
    Sync,
    UnavailableError,
)
from onnxps.server.app import ServerHandle

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adagrad": Adagrad(epsilon=1e-6, decay_factor=0.1, norm_coefficient=0.01),
    "momentum": Momentum(alpha=0.9, beta=0.1, mode="standard", norm_coefficient=0.01),
    "nesterov": Momentum(alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=0.0),
    "adam": Adam(norm_coefficient=0.01, norm_coefficient_post=0.001),
}


async def _sequence(
    ps: Any, group: str, optimizer: OptimizerSpec, dtype: str
) -> list[Any]:
    rng = np.random.default_rng(7)
    x0 = [rng.standard_normal(s).astype(dtype) for s in ((3, 4), (5,), ())]
    grads = [[rng.standard_normal(a.shape).astype(dtype) for a in x0] for _ in range(5)]
    seen: list[Any] = []
    info = await ps.create_group(
        group,
        optimizer,
        learning_rate=0.1,
        tensors=[("w", x0[0]), ("b", x0[1]), ("s", x0[2])],
        consistency=Async(max_staleness=2),
    )
    seen.append(info.update_count)
    seen.append(await ps.push(group, *grads[0]))
    seen.append(_flat(await ps.push(group, *grads[1], return_values=True)))
    seen.append((await ps.set_learning_rate(group, 0.05)).learning_rate)
    seen.append(await ps.push(group, *grads[2], learning_rate=0.02, base_version=1))
    seen.append(_flat(await ps.push_detailed(group, *grads[3], return_values=True)))
    with pytest.raises(FailedPreconditionError) as stale:
        await ps.push(group, *grads[4], base_version=0)
    seen.append((stale.value.reason, stale.value.metadata["update_count"]))
    t, state = await ps.pull_versioned(group, state=True)
    seen.append([t, _flat(state)])
    r = np.asarray(0.1, dtype)
    n = len(x0)
    seen.append(
        _flat(await ps.apply(optimizer, r, t, *state[:n], *grads[4], *state[n:]))
    )
    seen.append(_flat(await ps.pull(group, min_version=t)))
    seen.append((await ps.describe_group(group)).update_count)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_client_and_async_client_end_bit_identical(
    server: ServerHandle, transport: str, name: str, dtype: str
) -> None:
    settings: dict[str, Any] = {"timeout": 30, "transport": transport}
    if transport == "stream":
        settings["chunk_bytes"] = 16  # several chunks a tensor
    optimizer = OPTIMIZERS[name]

    async def run() -> tuple[list[Any], list[Any]]:
        with Client(server.address, **settings) as c:
            blocking = await _sequence(_Awaiting(c), "sync", optimizer, dtype)
        async with AsyncClient(server.address, **settings) as ac:
            awaited = await _sequence(ac, "async", optimizer, dtype)
        return blocking, awaited

    blocking, awaited = asyncio.run(run())
    assert awaited == blocking
    assert blocking[-1] == 4


def test_async_client_has_the_api_of_client() -> None:
    def public(cls: type) -> dict[str, Any]:
        return {
            n: v
            for n, v in vars(cls).items()
            if not n.startswith("_") and inspect.isfunction(v)
        }

    sync, asynchronous = public(Client), public(AsyncClient)
    assert set(asynchronous) == set(sync) - {"push_background"}
    for name, fn in asynchronous.items():
        assert inspect.iscoroutinefunction(fn), name
        assert inspect.signature(fn) == inspect.signature(sync[name]), name
    assert "AsyncClient" in onnxps.client.__all__


def test_async_with_refuses_reuse_after_close(server: ServerHandle) -> None:
    async def run() -> None:
        async with AsyncClient(server.address, timeout=10) as ps:
            assert await ps.list_groups() == []
        with pytest.raises(ClientClosedError, match="create a new AsyncClient"):
            await ps.list_groups()
        with pytest.raises(ClientClosedError):
            async with ps:
                pass

    asyncio.run(run())


def test_errors_carry_reason_and_metadata(server: ServerHandle) -> None:
    async def run() -> None:
        async with AsyncClient(server.address, timeout=10) as ps:
            with pytest.raises(NotFoundError) as missing:
                await ps.pull("nope")
        assert missing.value.reason == "GROUP_NOT_FOUND"
        assert missing.value.metadata == {"group": "nope"}

    asyncio.run(run())


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_200_concurrent_pushes_equal_a_serial_replay_in_the_servers_order(
    server: ServerHandle, transport: str
) -> None:
    rng = np.random.default_rng(3)
    x0 = {"w": rng.standard_normal(64).astype(np.float32)}
    grads = [rng.standard_normal(64).astype(np.float32) for _ in range(200)]

    async def push_all() -> list[PushResult]:
        async with AsyncClient(server.address, timeout=60, transport=transport) as ps:  # type: ignore[arg-type]
            await ps.create_group("g", Adam(), learning_rate=0.01, tensors=x0)
            return await asyncio.gather(*(ps.push_detailed("g", g) for g in grads))

    results = asyncio.run(push_all())
    ts = [r.update_count for r in results]
    assert sorted(ts) == list(range(1, 201))
    assert all(r.applied and not r.duplicate for r in results)
    with Client(server.address, timeout=60) as c:
        t, state = c.pull_versioned("g", state=True)
        assert t == 200
        c.create_group("replay", Adam(), learning_rate=0.01, tensors=x0)
        for _, g in sorted(zip(ts, grads, strict=True), key=lambda p: p[0]):
            c.push("replay", g)
        replay = c.pull("replay", state=True)
    assert [a.tobytes() for a in state] == [a.tobytes() for a in replay]


async def _until(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    """Wait until ``condition()`` holds; fail after a generous ``seconds``."""
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.002)


def test_a_cancelled_waiting_pull_releases_the_server(server: ServerHandle) -> None:
    store = server.store
    x = np.zeros(4, np.float32)

    async def run() -> None:
        async with AsyncClient(server.address, timeout=60) as ps:
            await ps.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": x})
            waiting = asyncio.create_task(ps.pull("g", min_version=5))
            await _until(lambda: store.waiting_calls == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await _until(lambda: store.waiting_calls == 0)
            # answered within its own deadline: nothing holds the group
            assert await ps.push("g", x, timeout=5) == 1

    asyncio.run(run())


def test_a_cancelled_sync_push_releases_the_server(server: ServerHandle) -> None:
    store = server.store
    x = np.zeros(4, np.float32)

    async def run() -> None:
        async with AsyncClient(server.address, timeout=60) as ps:
            await ps.create_group(
                "s", Adagrad(), learning_rate=0.1, tensors={"x": x}, consistency=Sync(2)
            )
            # return_values: the push waits for the step its quorum completes
            waiting = asyncio.create_task(ps.push("s", x, return_values=True))
            await _until(lambda: store.waiting_calls == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await _until(lambda: store.waiting_calls == 0)

    asyncio.run(run())


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_one_deadline_covers_every_send_of_an_async_push(
    silent_address: str, transport: str
) -> None:
    async def run() -> None:
        async with AsyncClient(silent_address, timeout=60, transport=transport) as ps:  # type: ignore[arg-type]
            with pytest.raises(DeadlineExceededError) as info:
                await ps.push("g", np.zeros(3, np.float32), timeout=1.0)
            assert re.fullmatch(
                r"the push to group g \(seq \d+\) was not answered within 1 s",
                info.value.details,
            )

    asyncio.run(run())


def test_resends_to_an_unavailable_server_end_within_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens: every send is UNAVAILABLE, and resent
    caplog.set_level(logging.INFO, logger="onnxps.client")

    async def run() -> Exception:
        async with AsyncClient(address, timeout=60) as ps:
            with pytest.raises((UnavailableError, DeadlineExceededError)) as info:
                await ps.push("g", np.zeros(3, np.float32), timeout=0.5)
            return info.value

    error = asyncio.run(run())
    if isinstance(error, UnavailableError):
        assert "stayed unavailable for 0.5 s" in str(error)
    else:
        assert isinstance(error, DeadlineExceededError)
        assert waited_for(error.details) == 0.5
    # Resends wait within the deadline: five sends with backoff would wait 1.5 s.
    assert sum(resend_pauses(caplog.records)) <= 0.5


def test_heartbeats_run_as_a_task_until_leave(server: ServerHandle) -> None:
    x = np.zeros(2, np.float32)

    async def run() -> None:
        async with AsyncClient(server.address, timeout=10) as ps:
            await ps.create_group(
                "s",
                Adagrad(),
                learning_rate=0.1,
                tensors={"x": x},
                consistency=Sync(1),
                lease_seconds=0.3,
            )
            lease = await ps.join("s")
            assert lease.live_workers == 1
            await asyncio.sleep(1.0)  # three leases long: kept by the heartbeats
            assert (await ps.describe_group("s")).workers[0].alive
            assert (await ps.leave("s")).live_workers == 0

    asyncio.run(run())


# -- Client.push_background -----------------------------------------------------------


def test_push_background_returns_a_future_of_the_push(client: Client) -> None:
    x = np.ones(3, np.float32)
    client.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": x})
    future = client.push_background("g", x, base_version=0, return_values=True)
    result = future.result(timeout=10)
    assert result.update_count == 1 and result.applied
    assert result.values is not None
    assert result.values[0].tobytes() == client.pull("g")[0].tobytes()
    ahead = client.push_background("g", x, base_version=5)  # a T never pulled
    with pytest.raises(InvalidArgumentError, match="only at T=1"):
        ahead.result(timeout=10)


def test_push_background_copies_a_unary_pushs_gradients_when_called(
    server: ServerHandle,
) -> None:
    """The docstring's promise: the push is built when ``push_background`` returns
    (its seq taken, a unary push's gradients copied), so the next step may write
    into the gradient buffers while it waits for a background thread. The
    client's background threads are held (ops that wait on an event) while the
    push's gradient is overwritten; the server must step with the value it had
    at the call."""
    import threading
    from collections.abc import Generator

    from onnxps.client._client import BACKGROUND_PUSHES

    release = threading.Event()

    def hold() -> Generator[Any, Any, None]:
        yield from ()  # an op: a generator the client steps
        release.wait(30)

    x = np.zeros(3, np.float32)
    with Client(server.address, timeout=30) as a, Client(server.address) as e:
        a.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": x})
        held = [a._submit(hold()) for _ in range(BACKGROUND_PUSHES)]
        g = np.full(3, 2.0, np.float32)
        queued = a.push_background("g", g)
        g[:] = 1000.0  # the next step's gradient, written before the push ran
        assert not queued.done()  # it still waits for a thread
        release.set()
        assert [f.result(timeout=30) for f in held] == [None] * BACKGROUND_PUSHES
        assert queued.result(timeout=30).update_count == 1
        e.create_group("e", Adagrad(), learning_rate=0.1, tensors={"x": x})
        e.push("e", np.full(3, 2.0, np.float32))  # what [2, 2, 2] makes
        assert a.pull("g")[0].tobytes() == e.pull("e")[0].tobytes()


def test_close_waits_for_background_pushes_then_refuses_them(
    server: ServerHandle,
) -> None:
    x = np.ones(3, np.float32)
    c = Client(server.address, timeout=10)
    c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": x})
    futures = [c.push_background("g", x) for _ in range(8)]
    c.close()
    assert sorted(f.result(timeout=0).update_count for f in futures) == list(
        range(1, 9)
    )
    with pytest.raises(ClientClosedError):
        c.push_background("g", x)


async def _rows_sequence(ps: Any, group: str, dtype: str) -> list[Any]:
    rng = np.random.default_rng(11)
    table = rng.standard_normal((40, 6)).astype(dtype)
    bias = rng.standard_normal(6).astype(dtype)
    seen: list[Any] = []
    await ps.create_group(
        group,
        Adam(norm_coefficient=0.01),
        learning_rate=0.1,
        tensors={"emb": table, "b": bias},
    )
    idx = np.array([3, 17, 3, 39, 0], np.int32)  # repeats are summed first
    rows = rng.standard_normal((5, 6)).astype(dtype)
    seen.append(_flat(await ps.push_rows(group, {"emb": (idx, rows)})))
    dense_b = rng.standard_normal(6).astype(dtype)
    more = rng.standard_normal((2, 6)).astype(dtype)
    pushed = await ps.push_rows(
        group, {"emb": ([1, 3], more), "b": dense_b}, learning_rate=0.05
    )
    seen.append(_flat(pushed))
    got = await ps.pull_rows(group, {"emb": [3, 3, 0, 39]}, state=True)
    seen.append({k: _flat(v) for k, v in sorted(got.items())})
    seen.append(_flat(await ps.pull(group, min_version=2)))
    with pytest.raises(InvalidArgumentError) as bad:
        await ps.pull_rows(group, {"emb": [40]})
    seen.append(type(bad.value).__name__)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_client_and_async_client_rows_end_bit_identical(
    server: ServerHandle, dtype: str
) -> None:
    settings: dict[str, Any] = {"timeout": 30, "chunk_bytes": 64}  # several chunks

    async def run() -> tuple[list[Any], list[Any]]:
        with Client(server.address, **settings) as c:
            blocking = await _rows_sequence(_Awaiting(c), "rows-sync", dtype)
        async with AsyncClient(server.address, **settings) as ac:
            awaited = await _rows_sequence(ac, "rows-async", dtype)
        return blocking, awaited

    blocking, awaited = asyncio.run(run())
    assert awaited == blocking
    assert blocking[0][:3] == [1, True, False] and blocking[1][:3] == [2, True, False]
    assert set(blocking[2]) == {"emb", "V:emb", "H:emb"}


@pytest.mark.slow
@pytest.mark.parametrize("call", ["push", "push_rows"])
def test_an_async_push_resends_until_its_deadline_to_a_stopped_server(
    server_processes: StartServer,
    tmp_path: Path,
    call: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proc, address = server_processes(tmp_path / "s.log")

    async def run() -> UnavailableError:
        async with AsyncClient(address, timeout=10) as ps:
            await ps.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros((4, 2))}
            )
            proc.terminate()
            assert proc.wait(30) == 0
            with pytest.raises(UnavailableError) as err:
                if call == "push":
                    await ps.push("g", np.ones((4, 2)), timeout=2)
                else:
                    await ps.push_rows("g", {"x": ([1], np.ones((1, 2)))}, timeout=2)
            return err.value

    caplog.set_level(logging.INFO, logger="onnxps.client")
    error = asyncio.run(run())
    # Resent (logged) and given up only when the deadline ran out (the message),
    # never waiting past it.
    pauses = resend_pauses(caplog.records)
    assert pauses and sum(pauses) <= 2.0, pauses
    message = str(error)
    assert f"the server at {address} stayed unavailable for 2 s" in message
    assert "may not have been applied" in message
