"""Every bad input gets its exact status code and a message naming what was expected,
and leaves the stored state byte-identical; Apply stays the pure ONNX operator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    AlreadyExistsError,
    Client,
    InvalidArgumentError,
    Momentum,
    NotFoundError,
    RpcError,
)
from onnxps.client._errors import translate
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

Array = np.ndarray[Any, Any]
INVALID = grpc.StatusCode.INVALID_ARGUMENT

W0 = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
B0 = np.array([0.5, -1.5, 2.5], np.float32)
GW = np.full((4, 3), 0.25, np.float32)
GB = np.array([1.0, -1.0, 0.5], np.float32)


@pytest.fixture
def group(client: Client) -> str:
    """An Adam group 'g' (w (4, 3), b (3,), float32) that has taken one step."""
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0, "b": B0})
    assert client.push("g", GW, GB) == 1
    return "g"


def snapshot(client: Client, name: str = "g") -> tuple[int, list[bytes], float]:
    t, arrays = client.pull_versioned(name, state=True)
    return t, [a.tobytes() for a in arrays], client.describe_group(name).learning_rate


def expect_error(
    client: Client,
    call: Callable[[], Any],
    cls: type[RpcError],
    code: grpc.StatusCode,
    *fragments: str,
) -> RpcError:
    """Run ``call``; it must raise ``cls`` with ``code`` and leave group g as it was."""
    before = snapshot(client)
    groups = [g.name for g in client.list_groups()]
    with pytest.raises(cls) as info:
        call()
    assert info.value.code == code
    for fragment in fragments:
        assert fragment in info.value.details, (fragment, info.value.details)
    assert snapshot(client) == before
    assert [g.name for g in client.list_groups()] == groups
    return info.value


def raw(stub_method: Callable[..., Any], request: Any) -> Any:
    """Call the stub; grpc errors become the client's exceptions (its one mapping)."""
    try:
        return stub_method(request, timeout=10)
    except grpc.RpcError as exc:
        raise translate(exc) from None


def tensor(a: Array, **overrides: Any) -> pb.Tensor:
    fields = {"dtype": pb.DATA_TYPE_FLOAT, "dims": a.shape, "raw_data": a.tobytes()}
    fields.update(overrides)
    return pb.Tensor(**fields)


# -- unknown names, duplicates ---------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.push("nope", GW, GB),
        lambda c: c.pull("nope"),
        lambda c: c.pull_versioned("nope", state=True),
        lambda c: c.describe_group("nope"),
        lambda c: c.set_learning_rate("nope", 0.1),
        lambda c: c.delete_group("nope"),
    ],
    ids=["push", "pull", "pull_versioned", "describe", "set_lr", "delete"],
)
def test_unknown_group_is_not_found(
    client: Client, group: str, call: Callable[[Client], Any]
) -> None:
    err = expect_error(
        client, lambda: call(client), NotFoundError, grpc.StatusCode.NOT_FOUND, "'nope'"
    )
    assert isinstance(err, LookupError)


def test_unknown_group_through_streams(server: ServerHandle, group: str) -> None:
    with Client(server.address, timeout=10, transport="stream") as c:
        for call in (lambda: c.push("nope", GW, GB), lambda: c.pull("nope")):
            with pytest.raises(NotFoundError, match="no group named 'nope'") as info:
                call()
            assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_an_unknown_group_is_not_found_before_its_malformed_header(
    server: ServerHandle, group: str
) -> None:
    """The group is looked up before the gradients' headers are parsed: a push to
    a group that does not exist, whose header is malformed too (a tensor with no
    dtype), is NOT_FOUND on every transport (not INVALID_ARGUMENT)."""
    bad = pb.PushRequest(group="nope", gradients=[pb.Tensor()], client_id="h", seq=1)
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        stream = [pb.PushStreamRequest(header=bad)]
        for call in (
            lambda: raw(stub.Push, bad),
            lambda: stub.PushStream(iter(stream), timeout=10),
        ):
            with pytest.raises((NotFoundError, grpc.RpcError)) as info:
                call()
            err = info.value
            if isinstance(err, grpc.RpcError):
                assert err.code() == grpc.StatusCode.NOT_FOUND, err
            else:
                assert isinstance(err, NotFoundError), err


def test_duplicate_group_is_already_exists(client: Client, group: str) -> None:
    expect_error(
        client,
        lambda: client.create_group(
            "g", Adagrad(), learning_rate=1.0, tensors={"x": np.zeros(2, np.float32)}
        ),
        AlreadyExistsError,
        grpc.StatusCode.ALREADY_EXISTS,
        "group 'g' exists already",
    )


# -- pushes the store refuses ----------------------------------------------------------


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize(
    ("grads", "fragments"),
    [
        ((GW,), ["holds 2 tensors (w, b)", "expected 2 gradients", "got 1"]),
        ((GW, GB, GB), ["expected 2 gradients", "got 3"]),
        (
            (GW.astype(np.float64), GB),
            ["gradient 1 ('w') must be float32", "got float64"],
        ),
        ((GW, GB.astype(np.float64)), ["gradient 2 ('b') must be float32"]),
        ((GW.reshape(3, 4), GB), ["gradient 1 ('w') must have shape (4, 3)", "(3, 4)"]),
        ((GW, GB[:2]), ["gradient 2 ('b') must have shape (3,), got (2,)"]),
        ((GW, np.float32(1)), ["must have shape (3,), got ()"]),
    ],
    ids=[
        "too-few",
        "too-many",
        "dtype-1",
        "dtype-2",
        "shape-transposed",
        "shape-short",
        "shape-0d",
    ],
)
def test_bad_push_is_invalid_argument_and_changes_nothing(
    server: ServerHandle,
    client: Client,
    group: str,
    transport: str,
    grads: tuple[Array, ...],
    fragments: list[str],
) -> None:
    with Client(server.address, timeout=10, transport=transport) as c:  # type: ignore[arg-type]
        err = expect_error(
            client,
            lambda: c.push("g", *grads),
            InvalidArgumentError,
            INVALID,
            *fragments,
        )
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_non_finite_gradient_rejected_by_default(
    server: ServerHandle, client: Client, group: str, bad: float, transport: str
) -> None:
    gb = GB.copy()
    gb[1] = bad  # the first gradient is fine: nothing may step
    with Client(server.address, timeout=10, transport=transport) as c:  # type: ignore[arg-type]
        expect_error(
            client,
            lambda: c.push("g", GW, gb),
            InvalidArgumentError,
            INVALID,
            "gradient 2 ('b') holds NaN or inf",
            "allow_non_finite=True",
        )


def test_non_finite_gradient_accepted_with_allow_non_finite(client: Client) -> None:
    x = np.array([1.0, 2.0, 3.0], np.float32)
    client.create_group(
        "nf", Adagrad(), learning_rate=0.1, tensors={"x": x}, allow_non_finite=True
    )
    assert client.describe_group("nf").allow_non_finite is True
    assert client.push("nf", np.array([np.nan, np.inf, 1.0], np.float32)) == 1
    (got,) = client.pull("nf")
    assert np.isnan(got[0]) and np.isnan(got[1])  # inf / inf in the Adagrad step
    assert np.isfinite(got[2])


def test_non_finite_learning_rate_and_future_base_version(
    client: Client, group: str
) -> None:
    expect_error(
        client,
        lambda: client.push("g", GW, GB, learning_rate=float("nan")),
        InvalidArgumentError,
        INVALID,
        "learning_rate must be finite",
    )
    expect_error(
        client,
        lambda: client.set_learning_rate("g", float("inf")),
        InvalidArgumentError,
        INVALID,
        "learning_rate must be finite",
    )
    expect_error(
        client,
        lambda: client.push("g", GW, GB, base_version=5),
        InvalidArgumentError,
        INVALID,
        "computed against T=5",
        "only at T=1",
    )


# -- malformed tensor messages (only a raw stub can send them) -------------------------


@pytest.mark.parametrize(
    ("w", "fragments"),
    [
        (
            tensor(GW, raw_data=GW.tobytes()[:-4]),
            ["dims [4, 3], which is 48 bytes, but carries 44 bytes"],
        ),
        (tensor(GW, raw_data=GW.tobytes() + b"\0" * 4), ["48 bytes", "carries 52"]),
        (
            tensor(GW, dtype=5),
            ["data type 5", "expected FLOAT (1), DOUBLE (11) or INT64 (7)"],
        ),
        (tensor(GW, dtype=pb.DATA_TYPE_INT64), ["must be float32", "got int64"]),
        (tensor(GW, dims=[-4, -3]), ["negative dims [-4, -3]"]),
        (tensor(GW, dims=[12]), ["must have shape (4, 3), got (12,)"]),
    ],
    ids=["truncated", "too-long", "dtype-5", "dtype-int64", "negative-dims", "dims"],
)
def test_malformed_tensor_in_unary_push(
    client: Client,
    group: str,
    stub: pb_grpc.ParameterServerServiceStub,
    w: pb.Tensor,
    fragments: list[str],
) -> None:
    req = pb.PushRequest(group="g", gradients=[w, tensor(GB)])
    expect_error(
        client,
        lambda: raw(stub.Push, req),
        InvalidArgumentError,
        INVALID,
        *fragments,
    )


def test_malformed_tensor_in_stream_header(
    client: Client, group: str, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    header = pb.PushRequest(
        group="g",
        gradients=[
            pb.Tensor(dtype=pb.DataType.ValueType(5), dims=[4, 3]),
            tensor(GB, raw_data=b""),
        ],
    )
    expect_error(
        client,
        lambda: raw(stub.PushStream, iter([pb.PushStreamRequest(header=header)])),
        InvalidArgumentError,
        INVALID,
        "gradient 1 has data type 5",
    )


# -- broken streams --------------------------------------------------------------------


def push_header() -> pb.PushRequest:
    return pb.PushRequest(
        group="g",
        gradients=[tensor(GW, raw_data=b""), tensor(GB, raw_data=b"")],
    )


def chunk(index: int, offset: int, data: bytes) -> pb.PushStreamRequest:
    return pb.PushStreamRequest(
        chunk=pb.TensorChunk(index=index, offset=offset, data=data)
    )


W_BYTES, B_BYTES = GW.tobytes(), GB.tobytes()


@pytest.mark.parametrize(
    ("messages", "fragments"),
    [
        (
            [
                chunk(0, 24, W_BYTES[24:]),
                chunk(0, 0, W_BYTES[:24]),
                chunk(1, 0, B_BYTES),
            ],
            ["at byte offset 24, expected offset 0", "arrive in order"],
        ),
        (
            [chunk(0, 0, W_BYTES[:24]), chunk(1, 0, B_BYTES)],
            ["incomplete: 24 of 48 bytes received"],
        ),
        ([chunk(0, 0, W_BYTES)], ["gradient_2 ('b')", "incomplete: 0 of 12 bytes"]),
        (
            [chunk(0, 0, W_BYTES), chunk(1, 0, B_BYTES + b"\0\0\0\0")],
            ["is 12 bytes, but chunks reach byte 16"],
        ),
        (
            [chunk(0, 0, W_BYTES), chunk(1, 0, B_BYTES), chunk(1, 12, b"\0")],
            ["is 12 bytes, but chunks reach byte 13"],
        ),
        (
            [chunk(0, 0, W_BYTES), chunk(2, 0, B_BYTES)],
            ["tensor index 2, but the header lists 2 tensors"],
        ),
        (
            [chunk(0, 0, W_BYTES), pb.PushStreamRequest(header=push_header())],
            ["after the header a stream carries only chunks"],
        ),
    ],
    ids=[
        "out-of-order",
        "missing-chunk",
        "missing-tensor",
        "too-long",
        "extra-chunk",
        "bad-index",
        "second-header",
    ],
)
def test_broken_push_stream(
    client: Client,
    group: str,
    stub: pb_grpc.ParameterServerServiceStub,
    messages: list[pb.PushStreamRequest],
    fragments: list[str],
) -> None:
    stream = [pb.PushStreamRequest(header=push_header()), *messages]
    expect_error(
        client,
        lambda: raw(stub.PushStream, iter(stream)),
        InvalidArgumentError,
        INVALID,
        *fragments,
    )


def test_stream_without_header(
    client: Client, group: str, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    expect_error(
        client,
        lambda: raw(stub.PushStream, iter([chunk(0, 0, W_BYTES)])),
        InvalidArgumentError,
        INVALID,
        "a PushStream must begin with its header",
    )
    expect_error(
        client,
        lambda: raw(stub.PushStream, iter([])),
        InvalidArgumentError,
        INVALID,
        "must begin with its header",
    )
    create = pb.CreateGroupStreamRequest(
        chunk=pb.TensorChunk(index=0, offset=0, data=b"1234")
    )
    expect_error(
        client,
        lambda: raw(stub.CreateGroupStream, iter([create])),
        InvalidArgumentError,
        INVALID,
        "a CreateGroupStream must begin with its header",
    )
    apply = pb.ApplyStreamRequest(chunk=pb.TensorChunk(index=0, offset=0, data=b"1234"))
    expect_error(
        client,
        lambda: raw(lambda r, **kw: list(stub.ApplyStream(r, **kw)), iter([apply])),
        InvalidArgumentError,
        INVALID,
        "an ApplyStream must begin with its request header",
    )


def test_broken_create_stream_creates_nothing(
    client: Client, group: str, stub: pb_grpc.ParameterServerServiceStub
) -> None:
    header = pb.CreateGroupRequest(
        group="half",
        optimizer=Adagrad().to_proto(),
        learning_rate=0.1,
        tensors=[pb.Tensor(name="x", dtype=pb.DATA_TYPE_FLOAT, dims=[4, 3])],
    )
    stream = [
        pb.CreateGroupStreamRequest(header=header),
        pb.CreateGroupStreamRequest(
            chunk=pb.TensorChunk(index=0, offset=0, data=W_BYTES[:8])
        ),
    ]
    expect_error(
        client,
        lambda: raw(stub.CreateGroupStream, iter(stream)),
        InvalidArgumentError,
        INVALID,
        "tensor 'x'",
        "incomplete: 8 of 48 bytes",
    )


# -- optimizer attributes --------------------------------------------------------------


@dataclass(frozen=True)
class RawSpec:
    """An optimizer spec that sends a hand-built message."""

    proto: pb.OptimizerSpec

    def to_proto(self) -> pb.OptimizerSpec:
        return self.proto


BAD_SPECS: list[tuple[Any, list[str]]] = [
    (
        Momentum(0.9, 0.1, "sideways"),  # type: ignore[arg-type]
        ["Momentum mode must be 'standard' or 'nesterov', got 'sideways'"],
    ),
    (
        RawSpec(pb.OptimizerSpec(momentum=pb.Momentum(alpha=0.9, beta=0.1))),
        ["Momentum attribute 'mode' is required"],
    ),
    (
        RawSpec(
            pb.OptimizerSpec(momentum=pb.Momentum(alpha=0.9, beta=0.1, mode="standard"))
        ),
        ["Momentum attribute 'norm_coefficient' is required"],
    ),
    (Adagrad(epsilon=-1e-3), ["Adagrad epsilon must be >= 0"]),
    (Adam(epsilon=-1.0), ["Adam epsilon must be >= 0, got -1.0"]),
    (Adam(alpha=float("nan")), ["Adam attribute 'alpha' must be finite"]),
    (
        RawSpec(pb.OptimizerSpec()),
        ["optimizer is not set: expected one of adagrad, momentum or adam"],
    ),
]
BAD_SPEC_IDS = [
    "bad-mode",
    "no-mode",
    "no-norm",
    "adagrad-eps",
    "adam-eps",
    "nan-alpha",
    "no-optimizer",
]


@pytest.mark.parametrize(("spec", "fragments"), BAD_SPECS, ids=BAD_SPEC_IDS)
def test_bad_optimizer_attributes_create_nothing(
    client: Client, group: str, spec: Any, fragments: list[str]
) -> None:
    expect_error(
        client,
        lambda: client.create_group(
            "bad", spec, learning_rate=0.1, tensors={"x": np.zeros(3, np.float32)}
        ),
        InvalidArgumentError,
        INVALID,
        *fragments,
    )


@pytest.mark.parametrize(("spec", "fragments"), BAD_SPECS, ids=BAD_SPEC_IDS)
def test_bad_optimizer_attributes_in_apply(
    client: Client, group: str, spec: Any, fragments: list[str]
) -> None:
    x = np.zeros(3, np.float32)
    inputs = [np.float32(0.1), np.int64(0), x, x, x, x]  # 4 tensors: fits Adam only
    expect_error(
        client, lambda: client.apply(spec, *inputs), InvalidArgumentError, INVALID,
        *fragments,
    )  # fmt: skip


def test_bad_group_definitions(client: Client, group: str) -> None:
    def create(**kw: Any) -> Callable[[], Any]:
        args: dict[str, Any] = {"learning_rate": 0.1}
        args.update(kw)
        return lambda: client.create_group("bad", Adagrad(), **args)

    cases: list[tuple[Callable[[], Any], str]] = [
        (create(tensors={}), "needs at least one tensor"),
        (
            create(tensors={"x": np.zeros(2, np.int64)}),
            "must be float32 or float64, got int64",
        ),
        (
            create(tensors={"x": np.zeros(2, np.float32), "y": np.zeros(2)}),
            "a group has one dtype",
        ),
        (
            create(tensors=[("x", np.zeros(2)), ("x", np.zeros(2))]),
            "tensor name 'x' appears twice",
        ),
        (
            create(tensors={"x": np.array([1.0, np.nan])}),
            "initial value of 'x' holds NaN or inf",
        ),
        (
            create(tensors={"x": np.zeros(2)}, learning_rate=float("inf")),
            "learning_rate must be finite",
        ),
        (
            create(tensors={"x": np.zeros(2)}, state=[np.zeros(3)]),
            "state H of 'x' must be float64 (2,), got float64 (3,)",
        ),
        (
            create(tensors={"x": np.zeros(2)}, state=[np.zeros(2), np.zeros(2)]),
            "1 arrays, got 2",
        ),
        (
            create(tensors={"x": np.zeros(2)}, update_count=-1),
            "update_count must be >= 0",
        ),
    ]
    for call, fragment in cases:
        expect_error(client, call, InvalidArgumentError, INVALID, fragment)


# -- Apply is the pure operator --------------------------------------------------------


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_apply_propagates_nan_and_inf(server: ServerHandle, transport: str) -> None:
    x = np.array([1.0, 2.0, 3.0], np.float32)
    g = np.array([np.nan, 1.0, np.inf], np.float32)
    h = np.zeros(3, np.float32)
    with Client(server.address, timeout=10, transport=transport) as c:  # type: ignore[arg-type]
        x_new, h_new = c.apply(Adagrad(), np.float32(0.1), np.int64(0), x, g, h)
    assert np.isnan(x_new[0]) and np.isnan(h_new[0])
    assert np.isfinite(x_new[1]) and h_new[1] == 1.0
    assert np.isnan(x_new[2]) and h_new[2] == np.inf  # inf / inf


def test_apply_wrong_inputs(client: Client) -> None:
    x = np.zeros(3, np.float32)
    r, t = np.float32(0.1), np.int64(0)
    cases: list[tuple[list[Any], str]] = [
        ([r, t, x, x], "2 + 3*n inputs with n >= 1, got 4"),
        ([r, t, x, x, np.zeros(2, np.float32)], "H_1 must have the shape of X_1"),
        ([r, t, x, x.astype(np.float64), x], "G_1 is float64"),
        ([r, np.int64(-1), x, x, x], "T counts the updates already applied: >= 0"),
        ([np.zeros(2, np.float32), t, x, x, x], "R must be a scalar"),
    ]
    for inputs, fragment in cases:
        with pytest.raises(InvalidArgumentError) as info:
            client.apply(Adagrad(), *inputs)
        assert info.value.code == INVALID
        assert fragment in info.value.details, info.value.details
