"""Concurrent pushes to one group: none lost, none torn, and the state equals a serial
replay (in the order the server applied them) bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from onnxps.client import Adam, Client
from onnxps.server.app import ServerHandle
from onnxps.server.kernels import apply_onnx

Array = np.ndarray[Any, Any]

THREADS = 8
PUSHES = 6
SPEC = Adam(alpha=0.85, beta=0.99, epsilon=1e-5, norm_coefficient=0.01)
ATTRS = {"alpha": 0.85, "beta": 0.99, "epsilon": 1e-5, "norm_coefficient": 0.01}
LR = 0.05
X0 = {
    "w": np.linspace(-1, 1, 257, dtype=np.float32),
    "s": np.array(0.75, np.float32),
}


def gradients(thread: int, step: int) -> list[Array]:
    rng = np.random.default_rng(1000 * thread + step)
    return [rng.standard_normal(x.shape).astype(np.float32) for x in X0.values()]


def learning_rate(thread: int, step: int) -> float | None:
    return 0.01 * (thread + 1) if step % 3 == 2 else None


def run_threads(target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def replay(applied: dict[int, tuple[list[Array], float | None]]) -> list[list[Array]]:
    """The state (X..., V..., H...) after each T = 0, 1, ... replayed serially."""
    state = [*X0.values(), *[np.zeros_like(x) for x in X0.values()] * 2]
    states = [state]
    n = len(X0)
    for t in range(len(applied)):
        grads, lr = applied[t + 1]
        r = np.float64(LR if lr is None else lr)
        state = apply_onnx(
            "Adam", ATTRS, [r, np.int64(t), *state[:n], *grads, *state[n:]]
        )
        states.append(state)
    return states


def assert_bit_identical(got: list[Array], expected: list[Array]) -> None:
    assert [a.dtype for a in got] == [a.dtype for a in expected]
    assert [a.shape for a in got] == [a.shape for a in expected]
    assert [a.tobytes() for a in got] == [a.tobytes() for a in expected]


@pytest.mark.parametrize("clients", ["shared", "separate"])
def test_concurrent_pushes_equal_serial_replay(
    server: ServerHandle, clients: str
) -> None:
    shared = Client(server.address, timeout=30)
    own = [
        Client(server.address, timeout=30, transport="stream" if i % 2 else "unary")
        for i in range(THREADS)
    ]
    pick = (lambda i: shared) if clients == "shared" else (lambda i: own[i])
    applied: dict[int, tuple[list[Array], float | None]] = {}
    seen: list[tuple[int, list[Array]]] = []
    lock = threading.Lock()
    start = threading.Barrier(THREADS + 1)
    done = threading.Event()
    try:
        shared.create_group("c", SPEC, learning_rate=LR, tensors=X0)

        def worker(i: int) -> None:
            c = pick(i)
            start.wait(timeout=30)
            for step in range(PUSHES):
                grads, lr = gradients(i, step), learning_rate(i, step)
                result = c.push_detailed("c", *grads, learning_rate=lr)
                assert result.applied and not result.duplicate
                with lock:
                    assert result.update_count not in applied
                    applied[result.update_count] = (grads, lr)

        def reader() -> None:
            with Client(server.address, timeout=30) as c:
                start.wait(timeout=30)
                while not done.is_set():
                    seen.append(c.pull_versioned("c", state=True))

        reader_thread = threading.Thread(target=reader)
        reader_thread.start()
        run_threads(worker)
        done.set()
        reader_thread.join(timeout=30)

        total = THREADS * PUSHES
        assert sorted(applied) == list(range(1, total + 1))
        states = replay(applied)
        t, final = shared.pull_versioned("c", state=True)
        assert t == total == shared.describe_group("c").update_count
        assert_bit_identical(final, states[total])
        # every concurrent pull saw exactly the state after some whole push
        assert seen, "the reader pulled nothing"
        for version, arrays in seen:
            assert_bit_identical(arrays, states[version])
    finally:
        shared.close()
        for c in own:
            c.close()


def test_concurrent_groups_step_independently(server: ServerHandle) -> None:
    names = [f"g{i}" for i in range(THREADS)]
    with Client(server.address, timeout=30) as c:
        for name in names:
            c.create_group(name, SPEC, learning_rate=LR, tensors=X0)

        def worker(i: int) -> None:
            for step in range(PUSHES):
                c.push(names[i], *gradients(0, step))

        run_threads(worker)
        serial: dict[int, tuple[list[Array], float | None]] = {
            t + 1: (gradients(0, t), None) for t in range(PUSHES)
        }
        expected = replay(serial)[PUSHES]
        for name in names:
            t, state = c.pull_versioned(name, state=True)
            assert t == PUSHES
            assert_bit_identical(state, expected)
