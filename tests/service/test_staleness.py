"""Bounded staleness (async), late pushes (sync), future versions, push-and-pull."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Async,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    Sync,
)
from onnxps.server.app import ServerHandle
from onnxps.server.kernels import AdagradAttrs, apply_onnx

X0 = np.array([1.0, -2.0, 3.0], np.float64)
ONE = np.ones(3, np.float64)


def _adagrad(x: np.ndarray, h: np.ndarray, g: np.ndarray, t: int) -> list[np.ndarray]:
    return apply_onnx("Adagrad", AdagradAttrs(), [0.5, t, x, g, h])


def _advance(client: Client, name: str, steps: int) -> None:
    for _ in range(steps):
        client.push(name, ONE)


def test_async_max_staleness_refuses_beyond_the_bound_and_accepts_within(
    client: Client,
) -> None:
    client.create_group(
        "stale",
        Adagrad(),
        learning_rate=0.5,
        tensors={"x": X0},
        consistency=Async(max_staleness=2),
    )
    _advance(client, "stale", 5)
    with pytest.raises(FailedPreconditionError) as exc:
        client.push("stale", ONE, base_version=2)
    assert exc.value.code.name == "FAILED_PRECONDITION"
    assert exc.value.details == (
        "stale push to 'stale': computed against T=2, the group is at T=5 and "
        "max_staleness=2 accepts T >= 3; pull and recompute"
    )
    assert client.describe_group("stale").update_count == 5  # nothing changed
    assert client.push("stale", ONE, base_version=3) == 6  # exactly at the bound
    assert client.push("stale", ONE, base_version=6) == 7  # fresh
    with pytest.raises(FailedPreconditionError, match=r"the group is at T=7 and "):
        client.push("stale", ONE, base_version=4)
    assert client.push("stale", ONE, base_version=5) == 8


def test_max_staleness_zero_takes_only_the_current_version(client: Client) -> None:
    client.create_group(
        "zero",
        Adagrad(),
        learning_rate=0.5,
        tensors={"x": X0},
        consistency=Async(max_staleness=0),
    )
    assert client.push("zero", ONE, base_version=0) == 1
    with pytest.raises(FailedPreconditionError, match="accepts T >= 1;"):
        client.push("zero", ONE, base_version=0)
    assert client.push("zero", ONE, base_version=1) == 2


def test_without_a_bound_any_past_version_is_accepted(client: Client) -> None:
    client.create_group("free", Adagrad(), learning_rate=0.5, tensors={"x": X0})
    _advance(client, "free", 3)
    assert client.push("free", ONE, base_version=0) == 4


@pytest.mark.parametrize("consistency", [Async(max_staleness=1), Async(), Sync(2)])
def test_a_future_base_version_is_invalid_argument(
    client: Client, consistency: Async | Sync
) -> None:
    client.create_group(
        "future",
        Adagrad(),
        learning_rate=0.5,
        tensors={"x": X0},
        consistency=consistency,
    )
    with pytest.raises(InvalidArgumentError) as exc:
        client.push("future", ONE, base_version=1)
    assert exc.value.code.name == "INVALID_ARGUMENT"
    assert exc.value.details == (
        "push computed against T=1, but group 'future' is only at T=0: "
        "base_version must be a T the worker pulled"
    )
    info = client.describe_group("future")
    assert (info.update_count, info.pending_contributions) == (0, 0)


def test_sync_late_push_is_refused_and_the_step_is_unchanged(
    server: ServerHandle, client: Client
) -> None:
    client.create_group(
        "late",
        Adagrad(),
        learning_rate=0.5,
        tensors={"x": X0},
        consistency=Sync(2),
    )
    with (
        Client(server.address, client_id="a") as a,
        Client(server.address, client_id="b") as b,
    ):
        assert a.push_detailed("late", ONE, base_version=0).applied is False
        with pytest.raises(FailedPreconditionError) as exc:
            a.push("late", ONE, base_version=0)  # a second push for the same step
        assert exc.value.details == (
            "client 'a' already pushed for step T=0 of sync group 'late'; wait for "
            "the step (pull min_version=1)"
        )
        assert b.push_detailed("late", 3 * ONE, base_version=0).applied is True
        x_after = client.pull("late", state=True)
        with pytest.raises(FailedPreconditionError) as exc:
            b.push("late", ONE, base_version=0)
        assert exc.value.details == (
            "stale push to sync group 'late': computed against T=0, but that step "
            "was already taken (T=1); pull min_version=1 and recompute"
        )
    info = client.describe_group("late")
    assert (info.update_count, info.pending_contributions) == (1, 0)
    for got, want in zip(x_after, client.pull("late", state=True), strict=True):
        np.testing.assert_array_equal(got, want, strict=True)
    expected = _adagrad(X0, np.zeros(3), 2 * ONE, 0)  # mean of 1 and 3
    np.testing.assert_array_equal(x_after[0], expected[0], strict=True)


def test_sync_push_with_return_values_waits_for_the_step(
    server: ServerHandle, client: Client
) -> None:
    client.create_group(
        "pp", Adagrad(), learning_rate=0.5, tensors={"x": X0}, consistency=Sync(2)
    )
    got: list[list[np.ndarray]] = []
    with (
        Client(server.address, client_id="a") as a,
        Client(server.address, client_id="b") as b,
    ):
        waiter = threading.Thread(
            target=lambda: got.append(a.push("pp", ONE, return_values=True))
        )
        waiter.start()
        deadline = time.monotonic() + 10
        while client.describe_group("pp").pending_contributions != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert got == []  # a waits for b
        values_b = b.push("pp", 3 * ONE, return_values=True)
        waiter.join(timeout=10)
    want = _adagrad(X0, np.zeros(3), 2 * ONE, 0)[0]
    np.testing.assert_array_equal(got[0][0], want, strict=True)
    np.testing.assert_array_equal(values_b[0], want, strict=True)
    assert client.describe_group("pp").update_count == 1


def test_async_push_with_return_values_returns_the_new_x(client: Client) -> None:
    client.create_group("ap", Adagrad(), learning_rate=0.5, tensors={"x": X0})
    values = client.push("ap", ONE, return_values=True)
    np.testing.assert_array_equal(
        values[0], _adagrad(X0, np.zeros(3), ONE, 0)[0], strict=True
    )
