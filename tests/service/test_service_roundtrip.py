"""Congruence: the same pushes applied locally with ``apply_onnx`` and through the
server give bit-identical X, V, H and T; the official ONNX node tests pass through
``Client.apply`` over the wire, as unary calls and as chunked streams."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_reference as ref
import pytest
from _servers import (
    OPTIMIZERS,
    Array,
    LocalGroup,
    assert_bit_identical,
    onnx_attrs,
)
from onnxps.client import Adagrad, Adam, Client, Momentum, OptimizerSpec
from onnxps.server.app import ServerHandle
from onnxps.server.kernels import apply_onnx


def initial_tensors(dtype: Any, rng: np.random.Generator) -> dict[str, Array]:
    return {
        "w": rng.standard_normal((4, 3)).astype(dtype),
        "b": rng.standard_normal(3).astype(dtype),
        "s": np.array(rng.standard_normal(), dtype=dtype),  # 0-d
    }


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_push_sequence_matches_local_apply_bit_for_bit(
    server: ServerHandle, name: str, dtype: Any, transport: str
) -> None:
    op, spec = OPTIMIZERS[name]
    rng = np.random.default_rng(7)
    tensors = initial_tensors(dtype, rng)
    local = LocalGroup(op, spec, 0.05, list(tensors.values()))
    with Client(server.address, timeout=30, transport=transport) as c:  # type: ignore[arg-type]
        info = c.create_group("g", spec, learning_rate=0.05, tensors=tensors)
        assert info.update_count == 0
        assert info.dtype == np.dtype(dtype)
        assert info.tensors == [("w", (4, 3)), ("b", (3,)), ("s", ())]
        for step in range(7):
            grads = [
                rng.standard_normal(tuple(t.shape)).astype(dtype) for t in local.xs
            ]
            lr = 0.2 if step in (2, 5) else None  # R for this push only
            if step == 4:
                assert c.set_learning_rate("g", 0.011).learning_rate == 0.011
                local.lr = 0.011
            t = c.push("g", *grads, learning_rate=lr)
            local.push(grads, lr)
            assert t == local.t == step + 1
        version, state = c.pull_versioned("g", state=True)
        assert version == 7
        assert_bit_identical(state, local.state())
        assert_bit_identical(c.pull("g"), local.xs)
        values = c.push("g", *[np.ones_like(x) for x in local.xs], return_values=True)
        local.push([np.ones_like(x) for x in local.xs])
        assert_bit_identical(values, local.xs)
        assert c.describe_group("g").update_count == 8


def test_resumed_group_continues_from_its_state_and_update_count(
    client: Client,
) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(5)
    v, h = rng.standard_normal(5), rng.random(5)
    g = rng.standard_normal(5)
    spec = Adam(alpha=0.7, beta=0.9)
    client.create_group(
        "resumed", spec, learning_rate=0.1, tensors={"x": x}, state=[v, h],
        update_count=5,
    )  # fmt: skip
    assert client.push("resumed", g) == 6
    expected = apply_onnx("Adam", onnx_attrs(spec), [0.1, np.int64(5), x, g, v, h])
    assert_bit_identical(client.pull("resumed", state=True), expected)


def test_zero_element_tensor_round_trips(client: Client) -> None:
    tensors = {"empty": np.zeros((2, 0), np.float32), "x": np.ones(2, np.float32)}
    client.create_group("z", Adagrad(), learning_rate=0.1, tensors=tensors)
    grads = [np.zeros((2, 0), np.float32), np.full(2, 0.5, np.float32)]
    assert client.push("z", *grads) == 1
    local = LocalGroup("Adagrad", Adagrad(), 0.1, list(tensors.values()))
    local.push(grads)
    assert_bit_identical(client.pull("z", state=True), local.state())


# -- the official ONNX node tests over the wire ---------------------------------------


def spec_for(op: str, attrs: dict[str, Any]) -> OptimizerSpec:
    spec: OptimizerSpec = {"Adagrad": Adagrad, "Momentum": Momentum, "Adam": Adam}[op](
        **attrs
    )
    return spec


# Generated from unrounded float64 attributes (see test_kernels_conformance).
OFFICIAL_NOT_BIT_EXACT = {"test_adam_multiple"}


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize("name", ref.NODE_TESTS)
def test_official_node_test_through_apply(
    server: ServerHandle, name: str, transport: str
) -> None:
    case = ref.load_node_test(name)
    with Client(server.address, timeout=30, transport=transport) as c:  # type: ignore[arg-type]
        got = c.apply(spec_for(case.op, case.attrs), *case.inputs)
    assert_bit_identical(got, apply_onnx(case.op, case.attrs, case.inputs))
    for g, e in zip(got, case.outputs, strict=True):
        assert g.dtype == np.float32 and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)
        if name not in OFFICIAL_NOT_BIT_EXACT:
            assert g.tobytes() == e.tobytes()


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_apply_float64_multi_tensor_at_later_step(
    server: ServerHandle, transport: str
) -> None:
    rng = np.random.default_rng(11)
    shapes = [(3, 2), (), (4,)]
    x = [rng.standard_normal(s) for s in shapes]
    g = [rng.standard_normal(s) for s in shapes]
    v = [rng.standard_normal(s) for s in shapes]
    h = [rng.random(s) for s in shapes]
    inputs = [np.float64(0.03), np.int64(9), *x, *g, *v, *h]
    spec = OPTIMIZERS["adam"][1]
    with Client(server.address, timeout=30, transport=transport) as c:  # type: ignore[arg-type]
        got = c.apply(spec, *inputs)
    expected = apply_onnx("Adam", onnx_attrs(spec), inputs)
    assert_bit_identical(got, expected)
    assert [a.shape for a in got] == shapes * 3
    for a, b in zip(got, ref.run("Adam", onnx_attrs(spec), inputs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
