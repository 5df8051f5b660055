"""The Apply RPC is the ONNX operator: G, V, H broadcast to X's shape (NumPy rules),
through a real server, as unary calls and as chunked streams, bit for bit against the
line-by-line reference; shapes the operator does not accept, and dims no array can
have, are INVALID_ARGUMENT."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import grpc
import numpy as np
import onnx_reference as ref
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    InvalidArgumentError,
    Momentum,
    Nesterov,
    OptimizerSpec,
)
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

Array = np.ndarray[Any, Any]

# Non-default attributes for every operator (and both Momentum modes).
OPTIMIZERS: dict[str, tuple[str, OptimizerSpec]] = {
    "adagrad": (
        "Adagrad",
        Adagrad(epsilon=1e-4, decay_factor=0.05, norm_coefficient=0.01),
    ),
    "momentum": ("Momentum", Momentum(0.85, 0.3, "standard", 0.02)),
    "nesterov": ("Momentum", Nesterov(0.8, 0.6, 0.015)),
    "adam": (
        "Adam",
        Adam(
            alpha=0.8,
            beta=0.95,
            epsilon=1e-5,
            norm_coefficient=0.01,
            norm_coefficient_post=0.002,
        ),
    ),
}

# Per tensor: the shapes of (X, G, V, H). Adagrad takes (X, G, H), Momentum (X, G, V).
TENSORS = [
    ((2, 3), (3,), (1, 3), (2, 1)),
    ((2, 3), (1, 3), (3,), ()),
    ((), (), (), ()),
    ((4, 1, 5), (1, 5), (4, 1, 1), (5,)),
    ((0, 3), (3,), (1, 3), (0, 1)),
    ((6,), (6,), (6,), (6,)),
]
ROLES = {"Adagrad": [0, 1, 3], "Momentum": [0, 1, 2], "Adam": [0, 1, 2, 3]}


def onnx_attrs(spec: OptimizerSpec) -> dict[str, Any]:
    return {k: v for k, v in asdict(spec).items() if v is not None}


def inputs_for(op: str, dtype: Any, t: int, seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    arrays = []
    for role in ROLES[op]:
        for shapes in TENSORS:
            a = rng.standard_normal(shapes[role])
            arrays.append(np.asarray(np.abs(a) + 0.01 if role == 3 else a, dtype))
    return [np.float64(0.05), np.int64(t), *arrays]


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("t", [0, 9])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_apply_broadcasts_like_the_reference(
    server: ServerHandle, name: str, t: int, dtype: Any, transport: str
) -> None:
    op, spec = OPTIMIZERS[name]
    inputs = inputs_for(op, dtype, t, seed=t)
    with Client(server.address, timeout=30, transport=transport) as c:  # type: ignore[arg-type]
        got = c.apply(spec, *inputs)
    expected = ref.run(op, onnx_attrs(spec), inputs)
    assert len(got) == len(expected) == len(TENSORS) * (len(ROLES[op]) - 1)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype == dtype
        assert g.shape == e.shape
        assert np.array_equal(g, e)
    x_shapes = [shapes[0] for shapes in TENSORS]
    assert [g.shape for g in got] == x_shapes * (len(ROLES[op]) - 1)


def test_apply_row_gradient_for_a_matrix(client: Client) -> None:
    """The issue's example: G of shape (3,) and (1, 3) for X of shape (2, 3)."""
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    h = np.zeros((2, 3), np.float32)
    row = np.array([1.0, 2.0, 4.0], np.float32)
    r, t = np.float32(0.5), np.int64(0)
    full = client.apply(Adagrad(), r, t, x, np.tile(row, (2, 1)), h)
    for g in (row, row.reshape(1, 3)):
        got = client.apply(Adagrad(), r, t, x, g, h)
        assert [(a.shape, a.dtype) for a in got] == [((2, 3), np.float32)] * 2
        assert np.array_equal(got[1], [[1.0, 4.0, 16.0]] * 2)
        for a, b in zip(got, full, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize(
    ("x_shape", "shape", "position", "name"),
    [
        ((3,), (2, 3), 3, "G_1"),  # would broadcast X itself to (2, 3)
        ((2, 3), (2,), 3, "G_1"),
        ((2, 3), (1, 2, 3), 4, "H_1"),
        ((), (1,), 4, "H_1"),
    ],
)
def test_apply_refuses_a_shape_that_does_not_broadcast_to_x(
    server: ServerHandle,
    transport: str,
    x_shape: tuple[int, ...],
    shape: tuple[int, ...],
    position: int,
    name: str,
) -> None:
    inputs: list[Any] = [np.float32(0.1), np.int64(0)]
    inputs += [np.ones(x_shape, np.float32) for _ in range(3)]
    inputs[position] = np.ones(shape, np.float32)
    with (
        Client(server.address, timeout=10, transport=transport) as c,  # type: ignore[arg-type]
        pytest.raises(InvalidArgumentError) as info,
    ):
        c.apply(Adagrad(), *inputs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"{name} must have the shape of X_1, {x_shape}, or a shape that broadcasts "
        f"to it, got {shape}"
    ) in info.value.details


# -- dims no array can have (issue 11, item 9) -----------------------------------------

R = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[], raw_data=np.float32(0.1).tobytes())
T = pb.Tensor(dtype=pb.DATA_TYPE_INT64, dims=[], raw_data=np.int64(0).tobytes())
UNREPRESENTABLE = {
    # Zero elements, but the other dims' product overflows what NumPy can address.
    "product-overflows": [0, 2**62, 2**62],
    "bytes-overflow": [0, 2**61],  # 2**61 float32 elements: 2**63 bytes
    "65-dims": [1] * 65,  # NumPy arrays have at most 64
}


def unrepresentable(dims: list[int]) -> pb.Tensor:
    empty = 0 in dims
    return pb.Tensor(
        dtype=pb.DATA_TYPE_FLOAT, dims=dims, raw_data=b"" if empty else b"\0" * 4
    )


@pytest.mark.parametrize("dims", UNREPRESENTABLE.values(), ids=UNREPRESENTABLE.keys())
def test_apply_dims_no_array_can_have(
    stub: pb_grpc.ParameterServerServiceStub, dims: list[int]
) -> None:
    tensor = unrepresentable(dims)
    request = pb.ApplyRequest(
        optimizer=Adagrad().to_proto(), inputs=[R, T, tensor, tensor, tensor]
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Apply(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "input 2" in (info.value.details() or "")


@pytest.mark.parametrize("dims", UNREPRESENTABLE.values(), ids=UNREPRESENTABLE.keys())
def test_apply_stream_dims_no_array_can_have(
    stub: pb_grpc.ParameterServerServiceStub, dims: list[int]
) -> None:
    header = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=dims)
    request = pb.ApplyRequest(
        optimizer=Adagrad().to_proto(), inputs=[R, T, header, header, header]
    )
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.ApplyStream(iter([pb.ApplyStreamRequest(request=request)]), timeout=10)
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "input 2" in (info.value.details() or "")


def test_apply_zero_elements_with_large_dims_still_works(client: Client) -> None:
    """The largest dims NumPy can address with zero elements are a valid empty X."""
    x = np.zeros((0, 2**61 - 1), np.float32)
    g = np.ones(1, np.float32)  # broadcasts to X's shape: still zero elements
    out = client.apply(Adagrad(), np.float32(0.1), np.int64(0), x, g, x)
    assert [(a.shape, a.dtype) for a in out] == [((0, 2**61 - 1), np.float32)] * 2
