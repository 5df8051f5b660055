"""A push whose reply is lost is retried with the same seq and applied exactly once.

``ReplyDropProxy`` sits between the client and the server on 127.0.0.1 and forwards
bytes both ways. Armed, it lets the request through and cuts both connections at the
first HTTP/2 HEADERS frame the server sends back, that is once the server has
handled the push but before any of its reply reaches the client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
import pytest
from _servers import ReplyDropProxy
from onnxps.client import Adam, Client, Sync
from onnxps.server.app import ServerHandle
from onnxps.server.errors import FailedPrecondition
from onnxps.server.kernels import AdagradAttrs, AdamAttrs, apply_onnx
from onnxps.server.store import DEDUP_WINDOW, Consistency, ParameterStore


@pytest.fixture
def proxy(server: ServerHandle) -> Iterator[ReplyDropProxy]:
    p = ReplyDropProxy(server.address)
    try:
        yield p
    finally:
        p.close()


X0 = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
G = np.full((3, 4), 0.25, np.float32)


def _one_adam_step(x: np.ndarray, g: np.ndarray, t: int = 0) -> list[np.ndarray]:
    zeros = np.zeros_like(x)
    return apply_onnx("Adam", AdamAttrs(), [0.1, t, x, g, zeros, zeros])


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_async_push_with_a_lost_reply_is_applied_once(
    client: Client, proxy: ReplyDropProxy, transport: Literal["unary", "stream"]
) -> None:
    client.create_group("once", Adam(), learning_rate=0.1, tensors={"x": X0})
    # frames="off": the proxy cuts gRPC's reply (test_frames.py: a frame's)
    worker = Client(
        proxy.address, client_id="w1", timeout=10, transport=transport, frames="off"
    )
    with worker:
        assert worker.pull_versioned("once")[0] == 0  # the connection is up
        proxy.armed.set()
        result = worker.push_detailed("once", G)
    assert proxy.dropped == 1
    assert proxy.connections == 2  # the retry came over a new connection
    assert (result.update_count, result.applied, result.duplicate) == (1, True, True)
    t, got = client.pull_versioned("once", state=True)
    assert t == 1
    for g, w in zip(got, _one_adam_step(X0, G), strict=True):
        np.testing.assert_array_equal(g, w, strict=True)


def test_lost_reply_of_push_and_pull_returns_the_values_of_its_step(
    client: Client, proxy: ReplyDropProxy
) -> None:
    client.create_group("pp", Adam(), learning_rate=0.1, tensors={"x": X0})
    with Client(proxy.address, client_id="w1", timeout=10, frames="off") as worker:
        worker.describe_group("pp")
        proxy.armed.set()
        values = worker.push("pp", G, return_values=True)
    assert proxy.dropped == 1
    assert client.describe_group("pp").update_count == 1
    np.testing.assert_array_equal(values[0], _one_adam_step(X0, G)[0], strict=True)


def test_sync_push_with_a_lost_reply_joins_its_step_once(
    client: Client, proxy: ReplyDropProxy, server: ServerHandle
) -> None:
    client.create_group(
        "sync", Adam(), learning_rate=0.1, tensors={"x": X0}, consistency=Sync(2)
    )
    g_a = np.full((3, 4), 0.5, np.float32)
    g_b = np.full((3, 4), -1.5, np.float32)
    with (
        Client(proxy.address, client_id="a", timeout=10, frames="off") as a,
        Client(server.address, client_id="b", timeout=10) as b,
    ):
        a.describe_group("sync")
        proxy.armed.set()
        first = a.push_detailed("sync", g_a, base_version=0)
        assert proxy.dropped == 1
        assert (first.update_count, first.applied, first.duplicate) == (0, False, True)
        assert client.describe_group("sync").pending_contributions == 1
        second = b.push_detailed("sync", g_b, base_version=0)
        assert (second.update_count, second.applied, second.duplicate) == (
            1,
            True,
            False,
        )
    t, got = client.pull_versioned("sync", state=True)
    assert t == 1
    mean = (g_a + g_b) / np.float32(2)  # a < b: the order combine_contributions uses
    for g, w in zip(got, _one_adam_step(X0, mean), strict=True):
        np.testing.assert_array_equal(g, w, strict=True)


def test_a_restarted_worker_with_the_same_client_id_is_not_a_duplicate(
    client: Client,
) -> None:
    client.create_group("restart", Adam(), learning_rate=0.1, tensors={"x": X0})
    results = []
    for _ in range(2):  # a worker process, then its replacement under the same id
        with Client(client.address, client_id="w7") as worker:
            results.append(worker.push_detailed("restart", G))
    assert [(r.update_count, r.duplicate) for r in results] == [(1, False), (2, False)]


def test_a_seq_older_than_the_dedup_window_is_refused() -> None:
    store = ParameterStore()
    store.create_group("g", AdagradAttrs(), 0.1, [("x", np.zeros(1))])
    grad = [np.ones(1)]
    for seq in range(1, DEDUP_WINDOW + 2):
        store.push("g", grad, client_id="w", seq=seq)
    assert store.describe("g").update_count == DEDUP_WINDOW + 1
    repeat = store.push("g", grad, client_id="w", seq=DEDUP_WINDOW + 1)
    assert (repeat.update_count, repeat.applied, repeat.duplicate) == (
        DEDUP_WINDOW + 1,
        True,
        True,
    )
    with pytest.raises(FailedPrecondition) as exc:
        store.push("g", grad, client_id="w", seq=1)
    assert str(exc.value) == (
        f"push seq 1 from client 'w' is older than the {DEDUP_WINDOW} pushes "
        "remembered for it; it cannot be deduplicated"
    )
    assert store.describe("g").update_count == DEDUP_WINDOW + 1
    store.close()


def test_a_retry_after_its_sync_step_is_answered_not_refused_as_late() -> None:
    """Dedup comes before the staleness check: the retry gets the first answer."""
    store = ParameterStore()
    store.create_group(
        "g",
        AdagradAttrs(),
        0.1,
        [("x", np.zeros(1))],
        consistency=Consistency("sync", 1),
    )
    first = store.push("g", [np.ones(1)], client_id="w", seq=5, base_version=0)
    again = store.push("g", [np.ones(1)], client_id="w", seq=5, base_version=0)
    assert (first.update_count, first.applied, first.duplicate) == (1, True, False)
    assert (again.update_count, again.applied, again.duplicate) == (1, True, True)
    with pytest.raises(FailedPrecondition) as exc:
        store.push("g", [np.ones(1)], client_id="w", seq=6, base_version=0)
    assert "that step was already taken (T=1)" in str(exc.value)
    assert store.describe("g").update_count == 1
    store.close()
