"""Encoded gradients and pulls through real servers: the step on an encoded push is,
bit for bit, the step on the gradient widened from the same bfloat16/float16 values
(every optimizer, float32 and float64 groups, multi-chunk tensors, unary and stream,
a cluster's split groups, AsyncClient, PushRows, after a WAL replay); pulled X equals
X rounded the same way; bad encodings and byte counts are refused with the state
unchanged; a resent encoded push is applied once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import ml_dtypes
import numpy as np
import pytest
from _servers import (
    OPTIMIZERS,
    LocalGroup,
    ReplyDropProxy,
    _crash,
    assert_bit_identical,
)
from onnxps.client import (
    Adam,
    AsyncClient,
    Client,
    EncodingRangeError,
    FailedPreconditionError,
    InvalidArgumentError,
    Momentum,
)
from onnxps.server.app import ServerHandle
from onnxps.server.interceptors.limits import declared_bytes, message_bytes
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import array_to_tensor, decode, encode, header_tensor

Array = np.ndarray[Any, Any]
Enc = Literal["bfloat16", "float16"]


def widened(g: Array, encoding: str) -> Array:
    """``g`` rounded to the encoding and widened back, without onnxps' codec."""
    if encoding == "float16":
        out = g.astype(np.float16).astype(g.dtype)
    else:
        out = g.astype(np.float32).astype(ml_dtypes.bfloat16).astype(g.dtype)
    # Random gradients never sit on a float32 tie, where float64 rounds once here.
    assert out.tobytes() == decode(encode(g, encoding)).tobytes()
    return out


def tensors(dtype: Any, rng: np.random.Generator) -> dict[str, Array]:
    return {
        "w": rng.standard_normal((40, 30)).astype(dtype),  # several chunks
        "b": rng.standard_normal(3).astype(dtype),
        "s": np.array(rng.standard_normal(), dtype=dtype),  # 0-d
    }


@pytest.mark.parametrize("encoding", ["bfloat16", "float16"])
@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_encoded_pushes_step_exactly_on_the_widened_gradient(
    servers: Callable[..., ServerHandle],
    name: str,
    dtype: Any,
    transport: Literal["unary", "stream"],
    encoding: Enc,
) -> None:
    server = servers(chunk_bytes=512)
    op, spec = OPTIMIZERS[name]
    rng = np.random.default_rng(5)
    init = tensors(dtype, rng)
    local = LocalGroup(op, spec, 0.05, list(init.values()))
    with Client(server.address, timeout=30, transport=transport, chunk_bytes=500) as c:
        c.create_group("g", spec, learning_rate=0.05, tensors=init)
        for step in range(3):
            grads = [
                rng.standard_normal(tuple(x.shape)).astype(dtype) for x in local.xs
            ]
            t = c.push("g", *grads, encoding=encoding)
            local.push([widened(g, encoding) for g in grads])
            assert t == step + 1
        assert_bit_identical(c.pull("g", state=True), local.state())
        # pulled encoded: X rounded the same way, widened to the group's dtype
        pulled = c.pull("g", encoding=encoding)
        assert_bit_identical(pulled, [widened(x, encoding) for x in local.xs])


def test_client_default_gradient_encoding_and_per_push_override(
    server: ServerHandle,
) -> None:
    rng = np.random.default_rng(8)
    x0 = rng.standard_normal(50).astype(np.float32)
    local = LocalGroup("Adam", Adam(), 0.1, [x0])
    with Client(server.address, gradient_encoding="float16") as c:
        assert (c.gradient_encoding, c.pull_encoding) == ("float16", "native")
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": x0})
        g1, g2, g3 = (rng.standard_normal(50).astype(np.float32) for _ in range(3))
        c.push("g", g1)  # the client's float16
        local.push([widened(g1, "float16")])
        c.push("g", g2, encoding="native")
        local.push([g2])
        c.push("g", g3, encoding="bfloat16")
        local.push([widened(g3, "bfloat16")])
        assert_bit_identical(c.pull("g", state=True), local.state())
    with pytest.raises(ValueError, match="gradient_encoding must be one of native"):
        Client(server.address, gradient_encoding="int8")  # type: ignore[arg-type]
    with Client(server.address) as c, pytest.raises(ValueError, match="encoding"):
        c.push("g", g1, encoding="fp8")  # type: ignore[call-overload]


@pytest.mark.parametrize("transport", ["unary", "stream"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pull_encoding_per_client_is_for_x_and_state_stays_native(
    servers: Callable[..., ServerHandle], transport: Any, dtype: type
) -> None:
    server = servers(chunk_bytes=256)
    rng = np.random.default_rng(9)
    init = tensors(dtype, rng)
    with Client(server.address, transport=transport) as trainer:
        trainer.create_group("g", Adam(), learning_rate=0.1, tensors=init)
        trainer.push("g", *[np.ones_like(x) for x in init.values()])
        exact = trainer.pull("g", state=True)
    with Client(server.address, transport=transport, pull_encoding="bfloat16") as c:
        assert_bit_identical(c.pull("g"), [widened(x, "bfloat16") for x in exact[:3]])
        assert_bit_identical(c.pull("g", encoding="native"), exact[:3])
        assert_bit_identical(
            c.pull("g", encoding="float16"), [widened(x, "float16") for x in exact[:3]]
        )
        assert_bit_identical(c.pull("g", state=True), exact)  # native
        t, xs = c.pull_versioned("g")
        assert t == 1 and xs[0].tobytes() == widened(exact[0], "bfloat16").tobytes()
        with pytest.raises(ValueError, match="state=True travels native"):
            c.pull("g", state=True, encoding="bfloat16")


def test_server_refuses_a_pull_with_state_or_an_unknown_encoding(
    server: ServerHandle,
) -> None:
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.ones(4)})
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        cases: list[tuple[Any, str]] = [
            (
                pb.PullRequest(
                    group="g", with_state=True, encoding=pb.ENCODING_BFLOAT16
                ),
                "for X alone",
            ),
            (
                pb.PullRequest(group="g", encoding=pb.Encoding.ValueType(7)),
                "encoding 7 is not one of",
            ),
        ]
        for req, message in cases:
            with pytest.raises(grpc.RpcError) as err:
                stub.Pull(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (err.value.details() or "")
            stream_req = pb.PullStreamRequest()
            stream_req.ParseFromString(req.SerializeToString())
            with pytest.raises(grpc.RpcError) as err:
                list(stub.PullStream(stream_req))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (err.value.details() or "")


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_pull_of_x_beyond_float16_is_refused_not_sent_as_inf(
    server: ServerHandle, transport: Any
) -> None:
    x = np.array([1.0, 7e4, -2.0], np.float32)
    with Client(server.address, transport=transport) as c:
        spec = Momentum(0.9, 1.0, "standard", 0.0)
        c.create_group("big", spec, learning_rate=0.1, tensors={"w": x})
        with pytest.raises(FailedPreconditionError) as err:
            c.pull("big", encoding="float16")
        assert err.value.reason == "OUT_OF_ENCODING_RANGE"
        assert "70000.0" in str(err.value) and "65504" in str(err.value)
        assert c.pull("big", encoding="bfloat16")[0].tolist() == [1.0, 70144.0, -2.0]


def test_float16_overflow_is_refused_by_the_client_before_sending(
    client: Client,
) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3)})
    with pytest.raises(EncodingRangeError) as err:
        client.push("g", np.array([0.5, 1e6, 0.0]), encoding="float16")
    assert "gradient 1 holds 1000000.0 (element 1)" in str(err.value)
    assert client.describe_group("g").update_count == 0


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_non_finite_encoded_gradients_are_refused_by_the_server(
    client: Client, transport: Any, server: ServerHandle
) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3)})
    before = client.pull("g", state=True)
    with Client(server.address, transport=transport) as c:
        for bad in (np.inf, np.nan):
            with pytest.raises(InvalidArgumentError, match="non-finite|NaN|inf"):
                c.push("g", np.array([0.5, bad, 0.0]), encoding="bfloat16")
    assert_bit_identical(client.pull("g", state=True), before)
    assert client.describe_group("g").update_count == 0


# -- malformed encoded requests, state unchanged --------------------------------------
def _stream(header: pb.PushRequest, chunks: list[pb.TensorChunk]) -> Iterator[Any]:
    yield pb.PushStreamRequest(header=header)
    for c in chunks:
        yield pb.PushStreamRequest(chunk=c)


def test_malformed_encoded_pushes_are_refused_with_the_state_unchanged(
    client: Client, server: ServerHandle
) -> None:
    x0 = np.arange(8, dtype=np.float32)
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"w": x0})
    before = client.pull("g", state=True)
    good = array_to_tensor(encode(np.ones(8, np.float32), "bfloat16"))

    def unary(t: pb.Tensor) -> pb.PushRequest:
        req = pb.PushRequest(group="g")
        req.gradients.add().CopyFrom(t)
        return req

    unknown = pb.Tensor()
    unknown.CopyFrom(good)
    unknown.encoding = 5  # type: ignore[assignment]
    short = pb.Tensor()
    short.CopyFrom(good)
    short.raw_data = good.raw_data[:15]
    native_bytes = pb.Tensor()
    native_bytes.CopyFrom(good)
    native_bytes.raw_data = np.ones(8, np.float32).tobytes()
    header = pb.PushRequest(group="g")
    header.gradients.add().CopyFrom(header_tensor(encode(np.ones(8, "f4"), "float16")))
    cases: list[tuple[str, Any, str]] = [
        ("Push", unary(unknown), "encoding 5: expected ENCODING_UNSPECIFIED"),
        (
            "Push",
            unary(short),
            "encoded as bfloat16, which is 16 bytes, but carries 15",
        ),
        ("Push", unary(native_bytes), "16 bytes, but carries 32 bytes"),
        (
            "PushStream",
            _stream(header, [pb.TensorChunk(index=0, offset=0, data=b"\0" * 5)]),
            "carries 5 bytes encoded as float16: the chunks of an encoded tensor hold "
            "whole 2-byte elements",
        ),
        (
            "PushStream",
            _stream(header, [pb.TensorChunk(index=0, offset=0, data=b"\0" * 10)]),
            "incomplete: 10 of 16 bytes encoded as float16 received",
        ),
        (
            "PushStream",
            _stream(header, [pb.TensorChunk(index=0, offset=0, data=b"\0" * 32)]),
            "is 16 bytes encoded as float16, but chunks reach byte 32",
        ),
    ]
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        for method, request, message in cases:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, method)(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in (err.value.details() or "")
    assert_bit_identical(client.pull("g", state=True), before)
    assert client.describe_group("g").update_count == 0


def test_tensors_other_than_gradients_must_travel_native(server: ServerHandle) -> None:
    encoded = array_to_tensor(encode(np.ones(4, np.float32), "bfloat16"), "w")
    create = pb.CreateGroupRequest(
        group="g", optimizer=Adam().to_proto(), learning_rate=0.1, tensors=[encoded]
    )
    apply = pb.ApplyRequest(
        optimizer=Adam().to_proto(),
        inputs=[
            array_to_tensor(np.float32(0.1)),
            array_to_tensor(np.int64(0)),
            array_to_tensor(np.ones(4, np.float32)),
            encoded,
            array_to_tensor(np.zeros(4, np.float32)),
            array_to_tensor(np.zeros(4, np.float32)),
        ],
    )
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        for method, req in (("CreateGroup", create), ("Apply", apply)):
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, method)(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "only gradients" in (err.value.details() or "")
            assert "send this tensor native" in (err.value.details() or "")
        assert not stub.ListGroups(pb.ListGroupsRequest()).groups


# -- exactly once, durability, cluster, asyncio, rows ---------------------------------
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_encoded_push_with_a_lost_reply_is_applied_once(
    client: Client, server: ServerHandle, transport: Any
) -> None:
    x0 = np.linspace(-1, 1, 300, dtype=np.float32)
    client.create_group("once", Adam(), learning_rate=0.1, tensors={"w": x0})
    g = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    local = LocalGroup("Adam", Adam(), 0.1, [x0])
    local.push([widened(g, "bfloat16")])
    proxy = ReplyDropProxy(server.address)
    try:
        with Client(
            proxy.address,
            client_id="w1",
            timeout=10,
            transport=transport,
            frames="off",  # the proxy cuts gRPC's reply
        ) as worker:
            proxy.armed.set()
            result = worker.push_detailed("once", g, encoding="bfloat16")
        assert proxy.dropped == 1
        assert proxy.connections == 2  # resent over a new connection
    finally:
        proxy.close()
    assert result.update_count == 1
    assert_bit_identical(client.pull("once", state=True), local.state())


def test_wal_replays_an_encoded_push_bit_identically(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    rng = np.random.default_rng(6)
    x0 = rng.standard_normal(1000)
    first = servers(data_dir=str(tmp_path), durability="wal", snapshot_interval=0)
    with Client(first.address, gradient_encoding="bfloat16") as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": x0})
        for _ in range(3):
            c.push("g", rng.standard_normal(1000))
        state = c.pull("g", state=True)
    _crash(first)  # no shutdown snapshot: the WAL alone has the pushes
    second = servers(data_dir=str(tmp_path), durability="wal", snapshot_interval=0)
    with Client(second.address) as c:
        assert c.describe_group("g").update_count == 3
        assert_bit_identical(c.pull("g", state=True), state)


def test_cluster_split_group_takes_encoded_pushes_and_pulls(
    servers: Callable[..., ServerHandle],
) -> None:
    shards = [servers(shard=f"{i}/2") for i in range(2)]
    rng = np.random.default_rng(12)
    x0 = {"w": rng.standard_normal(4000).astype(np.float32), "b": np.ones(3, "f4")}
    local = LocalGroup("Adam", Adam(), 0.1, list(x0.values()))
    with Client([s.address for s in shards], split_bytes=4096) as c:
        info = c.create_group("big", Adam(), learning_rate=0.1, tensors=x0)
        assert len(info.parts) > 1  # split across both shards
        for _ in range(2):
            grads = [
                rng.standard_normal(tuple(x.shape)).astype(np.float32) for x in local.xs
            ]
            c.push("big", *grads, encoding="float16")
            local.push([widened(g, "float16") for g in grads])
        assert_bit_identical(c.pull("big", state=True), local.state())
        pulled = c.pull("big", encoding="bfloat16")
        assert_bit_identical(pulled, [widened(x, "bfloat16") for x in local.xs])


def test_async_client_encodes_pushes_and_pulls(server: ServerHandle) -> None:
    rng = np.random.default_rng(13)
    x0 = rng.standard_normal(64)
    g = rng.standard_normal(64)
    local = LocalGroup("Adam", Adam(), 0.1, [x0])
    local.push([widened(g, "bfloat16")])

    async def run() -> tuple[list[Array], list[Array]]:
        async with AsyncClient(server.address, pull_encoding="float16") as c:
            await c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": x0})
            await c.push("g", g, encoding="bfloat16")
            return await c.pull("g", state=True), await c.pull("g")

    state, xs = asyncio.run(run())
    assert_bit_identical(state, local.state())
    assert_bit_identical(xs, [widened(local.xs[0], "float16")])


def test_push_rows_encodes_the_rows_not_the_indices(client: Client) -> None:
    rng = np.random.default_rng(14)
    table = rng.standard_normal((10, 4)).astype(np.float32)
    for name in ("enc", "ref"):
        client.create_group(name, Adam(), learning_rate=0.1, tensors={"e": table})
    idx = np.array([1, 7, 1])
    rows = rng.standard_normal((3, 4)).astype(np.float32)
    client.push_rows("enc", {"e": (idx, rows)}, encoding="bfloat16")
    client.push_rows("ref", {"e": (idx, widened(rows, "bfloat16"))})
    assert_bit_identical(client.pull("enc", state=True), client.pull("ref", state=True))
    assert client.pull("enc")[0].tobytes() != table.tobytes()


def test_encoded_push_counts_its_widened_bytes_in_flight() -> None:
    # what the server holds of an encoded push is the widened gradient: 4 bytes per
    # float32 element, although 2 travel (the in-flight budget and its gauge)
    g = encode(np.ones((300, 1000), np.float32), "bfloat16")
    header = pb.PushRequest(group="g", gradients=[header_tensor(g)])
    assert declared_bytes(pb.PushStreamRequest(header=header)) == 1_200_000
    unary = pb.PushRequest(group="g", gradients=[array_to_tensor(g)])
    assert len(unary.gradients[0].raw_data) == 600_000
    assert message_bytes(unary) == 1_200_000 + 256
    rows = pb.PushRowsHeader(group="g")
    rows.gradients.add(name="w", values=header_tensor(g))
    assert declared_bytes(pb.PushRowsRequest(header=rows)) == 1_200_000
