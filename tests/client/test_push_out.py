"""``push(..., return_values=True, out=arrays)``: X written into the caller's arrays.

On every transport (unary, stream, shared memory, tensor buffers, AsyncClient, a
cluster) the result's values are the ``out`` arrays and hold exactly what a push
without ``out`` returns. A streamed reply is assembled straight into them: the
client process allocates no array of X's size (measured with tracemalloc against a
server in its own process). A wrong ``out`` is refused before anything is sent.

Real servers on 127.0.0.1 port 0.
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxps.cli.process import start_server_process
from onnxps.client import Adam, AsyncClient, Client, Momentum
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.wire.shm import SHM_DIR

RNG = np.random.default_rng(5)
SHAPES = [(300, 70), (70,), (3, 4, 5)]
X0 = [RNG.standard_normal(s).astype(np.float32) for s in SHAPES]
GRADS = [[RNG.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(3)]


def _create(ps: Any, name: str, tensors: list[np.ndarray] = X0) -> None:
    ps.create_group(
        name,
        Adam(),
        learning_rate=0.01,
        tensors=[(f"x{i}", x) for i, x in enumerate(tensors)],
    )


def _fresh(like: list[np.ndarray]) -> list[np.ndarray]:
    return [np.full_like(x, np.nan) for x in like]


def _steps_with_and_without_out(ps: Client, grads: list[list[np.ndarray]]) -> None:
    """Push each step to a group with ``out`` and to a twin without: the same X,
    and the result's values are the very ``out`` arrays."""
    for g in grads:
        want = ps.push("plain", *g, return_values=True)
        out = _fresh(want)
        got = ps.push_detailed("into", *g, return_values=True, out=out)
        assert got.values is not None
        assert all(a is b for a, b in zip(got.values, out, strict=True))
        for a, b in zip(out, want, strict=True):
            np.testing.assert_array_equal(a, b, strict=True)
    np.testing.assert_array_equal(ps.pull("into")[0], ps.pull("plain")[0])


@pytest.mark.parametrize(
    "options",
    [
        {"transport": "unary", "shared_memory": "off"},
        {"transport": "stream", "shared_memory": "off"},
        pytest.param(
            {"shared_memory": "on"},
            marks=pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm"),
        ),
    ],
    ids=["unary", "stream", "shared-memory"],
)
def test_push_out_equals_a_push_without_it_on_every_transport(
    server: ServerHandle, options: dict[str, str]
) -> None:
    with Client(server.address, timeout=30.0, **options) as ps:  # type: ignore[arg-type]
        _create(ps, "plain")
        _create(ps, "into")
        _steps_with_and_without_out(ps, GRADS)
        assert ps.describe_group("into").update_count == len(GRADS)


def test_push_out_with_gradients_in_tensor_buffers(server: ServerHandle) -> None:
    with Client(server.address, timeout=30.0) as ps:
        _create(ps, "plain")
        _create(ps, "into")
        with ps.tensor_buffers("into") as bufs:
            for g in GRADS:
                want = ps.push("plain", *g, return_values=True)
                for b, gi in zip(bufs, g, strict=True):
                    b[...] = gi
                out = _fresh(want)
                values = ps.push("into", *bufs, return_values=True, out=out)
                assert all(a is b for a, b in zip(values, out, strict=True))
                for a, b in zip(out, want, strict=True):
                    np.testing.assert_array_equal(a, b, strict=True)


def test_async_client_push_out(server: ServerHandle) -> None:
    async def run() -> None:
        async with AsyncClient(server.address, timeout=30.0) as ps:
            await ps.create_group(
                "plain", Momentum(0.9, 1.0), learning_rate=0.1, tensors={"w": X0[0]}
            )
            await ps.create_group(
                "into", Momentum(0.9, 1.0), learning_rate=0.1, tensors={"w": X0[0]}
            )
            for g in GRADS:
                want = await ps.push("plain", g[0], return_values=True)
                out = _fresh(want)
                got = await ps.push("into", g[0], return_values=True, out=out)
                assert got[0] is out[0]
                np.testing.assert_array_equal(out[0], want[0], strict=True)

    asyncio.run(run())


def test_push_out_on_a_cluster_with_a_split_group(
    servers: Callable[..., ServerHandle],
) -> None:
    handles = [
        servers(ServerConfig(address="127.0.0.1:0", durability="none", shard=f"{i}/2"))
        for i in range(2)
    ]
    # split_bytes below the group's size: its X is cut in two parts
    with Client([h.address for h in handles], split_bytes=40_000) as ps:
        _create(ps, "plain")
        _create(ps, "into")
        assert len(ps.describe_group("into").parts) == 2
        _steps_with_and_without_out(ps, GRADS)


def test_a_strided_out_is_filled_too(client: Client) -> None:
    _create(client, "plain")
    _create(client, "into")
    want = client.push("plain", *GRADS[0], return_values=True)
    big = np.zeros((300, 140), np.float32)
    strided = big[:, ::2]  # not C-contiguous: filled by one copy
    out = [strided, *_fresh(want[1:])]
    values = client.push("into", *GRADS[0], return_values=True, out=out)
    assert values[0] is strided
    np.testing.assert_array_equal(big[:, ::2], want[0], strict=True)
    assert not big[:, 1::2].any()


def _refusal(client: Client, out: Any, **kwargs: Any) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        client.push("g", *GRADS[0], out=out, **kwargs)
    assert client.describe_group("g").update_count == 0  # nothing was sent
    return str(info.value)


def test_a_wrong_out_is_refused_before_anything_is_sent(client: Client) -> None:
    _create(client, "g")
    good = _fresh(X0)
    assert _refusal(client, good) == "out= receives X: it needs return_values=True"
    assert _refusal(client, good[:2], return_values=True) == (
        "out holds 2 arrays for 3 gradients: X comes back as one array per gradient"
    )
    wrong_shape = [np.empty((70, 300), np.float32), *good[1:]]
    assert _refusal(client, wrong_shape, return_values=True) == (
        "out[0] must be a writable float32 array of shape (300, 70) (gradient 1's), "
        "got float32 (70, 300)"
    )
    wrong_dtype = [good[0], good[1].astype(np.float64), good[2]]
    assert _refusal(client, wrong_dtype, return_values=True) == (
        "out[1] must be a writable float32 array of shape (70,) (gradient 2's), "
        "got float64 (70,)"
    )
    read_only = [good[0], good[1], good[2].copy()]
    read_only[2].flags.writeable = False
    assert _refusal(client, read_only, return_values=True) == (
        "out[2] must be a writable float32 array of shape (3, 4, 5) (gradient 3's), "
        "got read-only float32 (3, 4, 5)"
    )
    assert _refusal(client, [good[0], [0.0] * 70, good[2]], return_values=True) == (
        "out[1] must be a writable float32 array of shape (70,) (gradient 2's), "
        "got list"
    )
    aliased = [GRADS[0][0], good[1], good[2]]
    assert _refusal(client, aliased, return_values=True) == (
        "out[0] shares memory with a gradient: X needs arrays of its own"
    )
    assert _refusal(client, good[0], return_values=True) == (
        "out is a sequence of arrays (one per gradient), not an array"
    )


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[str]:
    proc, address = start_server_process(log=tmp_path / "server.log")
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _peak_bytes(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_streamed_reply_is_assembled_into_out_without_a_copy(
    server_process: str,
) -> None:
    x = np.zeros(8 << 20, np.float32)  # 32 MiB: a PushPullStream of 1 MiB chunks
    g = np.full_like(x, 0.5)
    out = [np.empty_like(x)]
    with Client(server_process, timeout=60.0, shared_memory="off") as ps:
        ps.create_group("big", Adam(), learning_rate=0.01, tensors={"w": x})
        ps.push("big", g, return_values=True, out=out)  # warm up

        def with_out() -> None:
            ps.push("big", g, return_values=True, out=out)

        def without_out() -> None:
            ps.push("big", g, return_values=True)

        peak_without = _peak_bytes(without_out)
        peak_with = _peak_bytes(with_out)
        np.testing.assert_array_equal(out[0], ps.pull("big")[0], strict=True)
    assert peak_without >= x.nbytes  # a fresh X was made
    assert peak_with < x.nbytes // 2  # the chunks landed in out


@pytest.mark.slow
def test_a_streamed_pull_is_assembled_into_out_without_a_copy(
    server_process: str,
) -> None:
    x = np.arange(8 << 20, dtype=np.float32)  # 32 MiB: a PullStream
    out = [np.empty_like(x)]
    with Client(server_process, timeout=60.0, shared_memory="off") as ps:
        ps.create_group("big", Adam(), learning_rate=0.01, tensors={"w": x})
        ps.pull("big", out=out)  # warm up
        peak_without = _peak_bytes(lambda: ps.pull("big"))
        peak_with = _peak_bytes(lambda: ps.pull("big", out=out))
        encoded = [np.empty_like(x)]
        got = ps.pull("big", out=encoded, encoding="bfloat16")
    assert got[0] is encoded[0]
    np.testing.assert_array_equal(out[0], x, strict=True)
    assert peak_without >= x.nbytes
    assert peak_with < x.nbytes // 2
    # bfloat16 keeps 8 significant bits: integers up to 256 exactly
    np.testing.assert_array_equal(encoded[0][:257], x[:257], strict=True)
