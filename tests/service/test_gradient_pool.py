"""Streamed pushes receive their gradients into buffers reused per group
(``server._receive``) and check each chunk for NaN and inf as it lands: memory
stays flat over many pushes, a deleted group's buffers are freed, and a bad
gradient is refused exactly as before (same status, reason, message; nothing
changes), wherever in the stream it is and however it is encoded."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from onnxps.client import Adam, Client, Encoding, InvalidArgumentError
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.kernels import make_attrs
from onnxps.server.kernels._select import fused_kernels
from onnxps.server.transports._receive import (
    IDLE_PER_KEY,
    MIN_POOLED_BYTES,
    GradientPool,
)

N = 2 << 20  # float32 elements: 8 MiB, 8 chunks of 1 MiB
F32 = np.dtype(np.float32)


@pytest.fixture(
    params=[
        "numpy",
        pytest.param(
            "numba",
            marks=pytest.mark.skipif(fused_kernels() is None, reason="no numba"),
        ),
    ]
)
def server(
    servers: Callable[..., ServerHandle], request: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerHandle]:
    monkeypatch.setenv("ONNXPS_KERNELS", request.param)
    handle = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    yield handle


def _client(server: ServerHandle) -> Client:
    return Client(server.address, timeout=60, transport="stream", shared_memory="off")


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.slow
def test_repeated_pushes_reuse_one_buffer_and_memory_stays_flat(
    server: ServerHandle,
) -> None:
    g = np.full(N, 1e-3, np.float64)  # 16 MiB
    tracemalloc.start()
    try:
        with _client(server) as ps:
            start = _traced()
            ps.create_group("p", Adam(), learning_rate=0.01, tensors={"w": g * 0})
            ps.push("p", g)  # the pool holds a buffer from now on
            base = _traced()
            tracemalloc.reset_peak()
            for _ in range(20):
                ps.push("p", g)
            peak = tracemalloc.get_traced_memory()[1] - base
            grown = _traced() - base
            assert ps.describe_group("p").update_count == 21
            # The frames of a push in flight, not a fresh 16 MiB gradient per push.
            assert peak < g.nbytes // 2, peak
            assert grown < (1 << 20), grown
            ps.delete_group("p")
            # X, V, H and the pooled gradient are gone with the group
            assert _traced() - start < (1 << 20), _traced() - start
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["first", "middle", "chunk edge", "last"])
@pytest.mark.parametrize("encoding", ["native", "bfloat16"])
def test_a_nan_anywhere_in_the_stream_is_refused_as_before(
    server: ServerHandle, where: str, encoding: Encoding
) -> None:
    x0 = np.linspace(-1, 1, N, dtype=np.float32)
    with _client(server) as ps:
        ps.create_group("p", Adam(), learning_rate=0.01, tensors={"w": x0, "b": x0})
        good = [np.full(N, 1e-3, np.float32), np.full(N, -1e-3, np.float32)]
        ps.push("p", *good, encoding=encoding)
        before = ps.pull("p", state=True)
        bad = [good[0].copy(), good[1].copy()]
        at = {"first": 0, "middle": N // 2 + 3, "chunk edge": (1 << 18) - 1}
        bad[1][at.get(where, N - 1)] = np.inf if where == "last" else np.nan
        for _ in range(2):  # the second lands in a buffer the first filled
            with pytest.raises(InvalidArgumentError) as err:
                ps.push("p", *bad, encoding=encoding)
            assert err.value.reason == "NON_FINITE_GRADIENT"
            assert (
                "gradient 2 ('b') holds NaN or inf, which would poison group 'p'"
                in (str(err.value))
            )
        after = ps.pull("p", state=True)
        assert ps.describe_group("p").update_count == 1
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b, strict=True)
        # the next good push steps from its own bytes, not the refused ones
        ps.push("p", *good, encoding=encoding)
        with Client(server.address, timeout=60, transport="unary") as ref:
            ref.create_group(
                "r", Adam(), learning_rate=0.01, tensors={"w": x0, "b": x0}
            )
            ref.push("r", *good, encoding=encoding)
            ref.push("r", *good, encoding=encoding)
            got, want = ps.pull("p", state=True), ref.pull("r", state=True)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b, strict=True)


def test_allow_non_finite_groups_take_a_streamed_nan(server: ServerHandle) -> None:
    with _client(server) as ps:
        ps.create_group(
            "p",
            Adam(),
            learning_rate=0.01,
            tensors={"w": np.zeros(N, np.float32)},
            allow_non_finite=True,
        )
        g = np.zeros(N, np.float32)
        g[5] = np.nan
        assert ps.push("p", g) == 1
        assert np.isnan(ps.pull("p")[0][5])


def test_concurrent_streamed_pushes_each_get_their_own_buffer(
    server: ServerHandle,
) -> None:
    x0 = np.linspace(-1, 1, N, dtype=np.float32)
    grads = {f"p{k}": np.full(N, 1e-3 * (k + 1), np.float32) for k in range(3)}
    errors: list[BaseException] = []
    with _client(server) as ps:
        for name in grads:
            ps.create_group(name, Adam(), learning_rate=0.01, tensors={"w": x0})

        def worker(name: str) -> None:
            try:
                for _ in range(4):
                    ps.push(name, grads[name])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in grads]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        with Client(server.address, timeout=60, transport="unary") as ref:
            for name, g in grads.items():
                ref.create_group(
                    f"r{name}", Adam(), learning_rate=0.01, tensors={"w": x0}
                )
                for _ in range(4):
                    ref.push(f"r{name}", g)
                np.testing.assert_array_equal(
                    ps.pull(name)[0], ref.pull(f"r{name}")[0], strict=True
                )


# -- the pool itself ---------------------------------------------------------------
SPEC = [(F32, (MIN_POOLED_BYTES // 4,))]


def test_a_lease_given_back_is_the_next_lease() -> None:
    pool = GradientPool()
    with pool.lease("g", SPEC) as a:
        first = a.arrays[0]
        with pool.lease("g", SPEC) as b:  # in use: another buffer
            assert b.arrays[0] is not first
    with pool.lease("g", SPEC) as c:
        assert c.arrays[0] is first or c.arrays[0] is b.arrays[0]
    assert pool.idle_bytes == IDLE_PER_KEY * MIN_POOLED_BYTES  # one set kept per key


def test_idle_sets_are_bounded_per_key_and_in_all() -> None:
    pool = GradientPool(max_bytes=3 * MIN_POOLED_BYTES)
    leases = [pool.lease("g", SPEC) for _ in range(IDLE_PER_KEY + 2)]
    for lease in leases:
        lease.release()
        lease.release()  # once only
    assert pool.idle_bytes == IDLE_PER_KEY * MIN_POOLED_BYTES
    for name in ("h", "i"):
        pool.lease(name, SPEC).release()
    assert pool.idle_bytes == 3 * MIN_POOLED_BYTES  # g's oldest went first
    small = pool.lease("g", [(F32, (10,))])
    small.release()
    assert pool.idle_bytes == 3 * MIN_POOLED_BYTES  # small ones are not kept


def test_drop_frees_a_group_and_its_leases_in_flight() -> None:
    pool = GradientPool()
    pool.lease("g", SPEC).release()
    pool.lease("h", SPEC).release()
    held = pool.lease("g", SPEC)
    pool.drop("g")
    held.release()
    assert pool.idle_bytes == MIN_POOLED_BYTES  # only h's
    with pool.lease("h", SPEC) as h:
        assert h.arrays[0].shape == SPEC[0][1]
    assert make_attrs("Adam", {}).op == "Adam"


def test_the_pool_keeps_nothing_while_the_host_is_low_on_memory() -> None:
    low = [False]
    pool = GradientPool(low_memory=lambda: low[0])
    pool.lease("g", SPEC).release()
    assert pool.idle_bytes == MIN_POOLED_BYTES
    low[0] = True
    pool.lease("h", SPEC).release()  # given back under pressure: all freed
    assert pool.idle_bytes == 0
    pool.lease("g", SPEC).release()
    assert pool.idle_bytes == 0
    low[0] = False
    pool.lease("g", SPEC).release()
    assert pool.idle_bytes == MIN_POOLED_BYTES


def test_memory_low_compares_available_memory_with_a_share_of_the_total() -> None:
    from onnxps.server.transports._receive import memory_low

    assert memory_low(share=1.01) is True  # available is never above the total
    assert memory_low(share=0.0) is False


def _metric(handle: ServerHandle, name: str) -> float:
    import urllib.request

    url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.parametrize(("budget", "kept"), [(None, 8 << 20), (0, 0), (4 << 20, 0)])
def test_the_pool_size_is_a_setting_and_a_metric(
    servers: Callable[..., ServerHandle], budget: int | None, kept: int
) -> None:
    extra: dict[str, Any] = {} if budget is None else {"gradient_pool_bytes": budget}
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", metrics_port=0, **extra)
    )
    with _client(handle) as c:
        c.create_group("g", Adam(), learning_rate=1e-3, tensors={"w": np.zeros(N, F32)})
        c.push("g", np.full(N, 1e-3, F32))  # 8 MiB, streamed
    assert _metric(handle, "onnxps_gradient_pool_bytes") == kept
