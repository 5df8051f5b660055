"""``Client.tensor_buffers``: gradients written straight into shared memory and X
pulled straight into it (``pull(out=)``), with the same results, statuses and
state as every other path; the rules of their lifetime are enforced.

Real servers in-process on 127.0.0.1 port 0, real segments (each test looks only
at the segments of its own pid).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from onnxps.client import (
    Adam,
    AsyncClient,
    Client,
    InvalidArgumentError,
    TensorBuffers,
)
from onnxps.server.app import (
    MIN_MESSAGE_BYTES,
    ServerConfig,
    ServerHandle,
)
from onnxps.wire.shm import SHM_DIR

pytestmark = pytest.mark.skipif(
    not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)"
)

N = 1 << 20  # 4 MiB of float32: more than these servers' messages carry
RNG = np.random.default_rng(11)
W0 = RNG.standard_normal(N).astype(np.float32)
B0 = RNG.standard_normal(33).astype(np.float32)
G = [RNG.standard_normal(N).astype(np.float32) for _ in range(3)]
GB = [RNG.standard_normal(33).astype(np.float32) for _ in range(3)]


def segments() -> list[str]:
    pid = os.getpid()
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"onnxps-{pid}-"))


@pytest.fixture
def small_messages(servers: Callable[..., ServerHandle]) -> Iterator[str]:
    """A server whose messages cannot carry a 4 MiB tensor: what passes went
    through shared memory."""
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            max_message_bytes=MIN_MESSAGE_BYTES,
        )
    )
    yield handle.address


def _create(c: Client, name: str) -> None:
    c.create_group(name, Adam(), learning_rate=0.01, tensors={"w": W0, "b": B0})


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, strict=True)


def test_pushes_and_pulls_of_buffers_equal_the_grpc_path_and_copy_nothing(
    small_messages: str, server: ServerHandle
) -> None:
    with (
        Client(small_messages, shared_memory="on", timeout=30) as shm,
        Client(server.address, shared_memory="off", timeout=30) as wire,
    ):
        _create(shm, "g")
        _create(wire, "g")
        grads = shm.tensor_buffers("g")
        values = shm.tensor_buffers("g")
        assert isinstance(grads, TensorBuffers) and grads.shared
        assert [a.shape for a in grads] == [(N,), (33,)]
        assert [a.dtype for a in grads] == [np.float32] * 2
        assert len(segments()) == 2  # the hello's is gone; one per TensorBuffers
        for g, gb in zip(G, GB, strict=True):
            np.copyto(grads[0], g)
            np.copyto(grads[1], gb)
            assert shm.push("g", *grads) == wire.push("g", g, gb)
            got = shm.pull("g", out=values)
            assert got[0] is values[0] and got[1] is values[1]  # no copy here
            _same(got, wire.pull("g"))
        # every push and pull of the buffers used their own segments, no other
        ours = segments()
        assert len(ours) == 2
        # a push of the buffers returning X (X comes back through the pool)
        x = shm.push("g", *grads, return_values=True)
        _same(x, wire.push("g", G[2], GB[2], return_values=True))
        _same(shm.pull("g", state=True), wire.pull("g", state=True))
        grads.close()
        values.close()
        # (mypy keeps .shared narrowed to True across close())
        assert not grads.shared and not values.shared  # type: ignore[unreachable]
        assert not set(ours) & set(segments())  # type: ignore[unreachable]
    assert segments() == []


def test_buffers_are_the_callers_and_the_rules_are_enforced(
    small_messages: str,
) -> None:
    with Client(small_messages, shared_memory="on", timeout=30) as ps:
        _create(ps, "g")
        with ps.tensor_buffers("g") as values:
            x = ps.pull("g", out=values)
            before = x[0].copy()
            # one call at a time: a pull waiting for T=1 holds the buffers
            waiting = threading.Thread(
                target=ps.pull, args=("g",), kwargs={"out": values, "min_version": 1}
            )
            waiting.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the pull holds them
                try:
                    with values.claimed():
                        pass
                except ValueError:
                    break
                time.sleep(0.01)
            with pytest.raises(ValueError, match="in use by another call"):
                ps.push("g", *values)
            with pytest.raises(ValueError, match="in use by another call"):
                ps.pull("g", out=values)
            assert ps.describe_group("g").update_count == 0
            ps.push("g", G[1], GB[1])
            waiting.join(30)
            assert not waiting.is_alive()
            assert not np.array_equal(values[0], before)  # the pull wrote them
            name = segments()
        kept = values[0].copy()
        assert not values.shared
        # after close: still the caller's memory with its last values, not shared
        np.testing.assert_array_equal(values[0], kept)
        assert len(segments()) < len(name)
        t = ps.push("g", *values)  # an ordinary push now (copied through the pool)
        assert t == ps.describe_group("g").update_count
        # out= must fit what the pull returns
        with pytest.raises(ValueError, match=r"out\[0\] must be a float32 array of"):
            ps.pull("g", out=[np.zeros(3, np.float32), np.zeros(33, np.float32)])
        with pytest.raises(ValueError, match="out holds 1 arrays; the pull returned 2"):
            ps.pull("g", out=[np.zeros(N, np.float32)])


def test_a_nan_written_into_the_buffers_is_refused_and_nothing_changes(
    small_messages: str,
) -> None:
    with Client(small_messages, shared_memory="on", timeout=30) as ps:
        _create(ps, "g")
        with ps.tensor_buffers("g") as grads:
            np.copyto(grads[0], G[0])
            np.copyto(grads[1], GB[0])
            ps.push("g", *grads)
            before = ps.pull("g", state=True)
            grads[0][N - 1] = np.nan
            with pytest.raises(InvalidArgumentError) as err:
                ps.push("g", *grads)
            assert err.value.reason == "NON_FINITE_GRADIENT"
            assert "gradient 1 ('w') holds NaN or inf" in str(err.value)
            _same(ps.pull("g", state=True), before)
            assert ps.describe_group("g").update_count == 1


def test_without_shared_memory_they_are_ordinary_arrays(server: ServerHandle) -> None:
    with (
        Client(server.address, shared_memory="off", timeout=30) as ps,
        Client(server.address, shared_memory="off", timeout=30) as ref,
    ):
        _create(ps, "g")
        _create(ref, "r")
        with ps.tensor_buffers("g") as grads:
            assert not grads.shared
            assert all(not a.any() for a in grads)
            np.copyto(grads[0], G[0])
            np.copyto(grads[1], GB[0])
            assert ps.push("g", *grads) == ref.push("r", G[0], GB[0])
            out = [np.empty(N, np.float32), np.empty(33, np.float32)]
            got = ps.pull("g", out=out)
            assert got[0] is out[0]
            _same(got, ref.pull("r"))
            state = [np.empty(n, np.float32) for _ in range(3) for n in (N, 33)]
            _same(ps.pull("g", state=True, out=state), ref.pull("r", state=True))
        assert segments() == []


def test_the_async_client_makes_them_too(small_messages: str) -> None:
    async def run() -> tuple[list[np.ndarray], list[np.ndarray]]:
        async with AsyncClient(small_messages, shared_memory="on", timeout=30) as c:
            await c.create_group(
                "a", Adam(), learning_rate=0.01, tensors={"w": W0, "b": B0}
            )
            grads = await c.tensor_buffers("a")
            values = await c.tensor_buffers("a")
            assert grads.shared
            np.copyto(grads[0], G[0])
            np.copyto(grads[1], GB[0])
            await c.push("a", *grads)
            got = await c.pull("a", out=values)
            assert got[0] is values[0]
            return [a.copy() for a in got], await c.pull("a")

    got, plain = asyncio.run(run())
    _same(got, plain)
    assert segments() == []  # the client's close() closed its buffers
