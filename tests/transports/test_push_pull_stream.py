"""PushPullStream: a push that returns X streams X back as the group steps.

The values must be exactly those a push and then a pull give (every optimizer,
float32 and float64, tensors of several blocks, several tensors), a resend of an
applied push answers as a Push with return_values does, a bad gradient changes
nothing, and a caller that leaves mid-reply leaves the server serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    AsyncClient,
    Client,
    InvalidArgumentError,
    Momentum,
    Nesterov,
    OptimizerSpec,
    Sync,
)
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.kernels import Stepper, make_attrs
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import (
    TensorAssembler,
    chunk_messages,
    header_tensor,
)

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adagrad": Adagrad(epsilon=1e-7, decay_factor=0.01),
    "momentum": Momentum(alpha=0.9, beta=0.5),
    "nesterov": Nesterov(alpha=0.8, beta=1.0, norm_coefficient=0.01),
    "adam": Adam(norm_coefficient=0.01, norm_coefficient_post=0.001),
}
# Larger than a Stepper block (1 MiB) and than a chunk: X comes back in many blocks.
SHAPES = [(700, 1000), (3,), (1, 5, 7)]
CHUNK = 64 << 10


@pytest.fixture
def small_chunks(servers: Callable[..., ServerHandle]) -> Iterator[ServerHandle]:
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", chunk_bytes=CHUNK)
    )
    yield handle


def _tensors(dtype: Any, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"x{i}": rng.standard_normal(s).astype(dtype) for i, s in enumerate(SHAPES)}


def _grads(dtype: Any, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_values_are_bit_identical_to_a_push_then_a_pull(
    small_chunks: ServerHandle, opt: str, dtype: Any
) -> None:
    with Client(
        small_chunks.address, timeout=60, transport="stream", chunk_bytes=CHUNK
    ) as ps:
        for name in ("one-call", "two-calls"):
            ps.create_group(
                name, OPTIMIZERS[opt], learning_rate=0.05, tensors=_tensors(dtype)
            )
        for step in range(3):
            grads = _grads(dtype, step)
            got = ps.push_detailed("one-call", *grads, return_values=True)
            assert ps.push("two-calls", *grads) == step + 1
            want = ps.pull("two-calls")
            assert (got.update_count, got.applied, got.duplicate) == (step + 1, 1, 0)
            assert got.values is not None and len(got.values) == len(SHAPES)
            for g, w in zip(got.values, want, strict=True):
                np.testing.assert_array_equal(g, w, strict=True)
                assert g.flags.writeable
        _, state1 = ps.pull_versioned("one-call", state=True)
        _, state2 = ps.pull_versioned("two-calls", state=True)
        for a, b in zip(state1, state2, strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


def _stub(
    handle: ServerHandle,
) -> tuple[grpc.Channel, pb_grpc.ParameterServerServiceStub]:
    channel = grpc.insecure_channel(
        handle.address,
        [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    )
    return channel, pb_grpc.ParameterServerServiceStub(channel)


def _messages(
    group: str, grads: list[np.ndarray], seq: int, client_id: str = "c"
) -> Iterator[pb.PushPullStreamRequest]:
    header = pb.PushRequest(
        group=group,
        client_id=client_id,
        seq=seq,
        gradients=[header_tensor(g) for g in grads],
    )
    yield pb.PushPullStreamRequest(header=header)
    yield from chunk_messages(pb.PushPullStreamRequest, grads, CHUNK)


def _read(reply: Any) -> tuple[pb.PushResponse, list[np.ndarray], int]:
    it = iter(reply)
    first = next(it)
    assert first.WhichOneof("part") == "header"
    header = first.header
    asm = TensorAssembler(list(header.values), [t.name for t in header.values])
    chunks = 0
    for msg in it:
        asm.add(msg.chunk)
        chunks += 1
    return header, asm.finish(), chunks


def test_the_rpc_streams_x_in_chunks_and_a_resend_is_answered_as_push_does(
    small_chunks: ServerHandle,
) -> None:
    grads = _grads(np.float32, 0)
    with Client(small_chunks.address, timeout=30) as ps:
        ps.create_group("g", Adam(), learning_rate=0.1, tensors=_tensors(np.float32))
        channel, stub = _stub(small_chunks)
        with channel:
            header, first, chunks = _read(
                stub.PushPullStream(_messages("g", grads, seq=7), timeout=30)
            )
            assert (header.update_count, header.applied, header.duplicate) == (
                1,
                True,
                False,
            )
            assert [t.name for t in header.values] == ["x0", "x1", "x2"]
            assert [tuple(t.dims) for t in header.values] == SHAPES
            assert all(not t.raw_data for t in header.values)
            assert chunks >= SHAPES[0][0] * SHAPES[0][1] * 4 // CHUNK
            for a, b in zip(first, ps.pull("g"), strict=True):
                np.testing.assert_array_equal(a, b, strict=True)
            # The resend is not applied again; it gets the group's current X, as a
            # Push with return_values does.
            header2, again, _ = _read(
                stub.PushPullStream(_messages("g", grads, seq=7), timeout=30)
            )
            assert (header2.update_count, header2.applied, header2.duplicate) == (
                1,
                True,
                True,
            )
            for a, b in zip(again, first, strict=True):
                np.testing.assert_array_equal(a, b, strict=True)
            unary = pb.PushRequest(group="g", client_id="c", seq=7, return_values=True)
            for g in grads:
                unary.gradients.add().CopyFrom(header_tensor(g))
                unary.gradients[-1].raw_data = g.tobytes()
            reply = stub.Push(unary, timeout=30)
            assert (reply.update_count, reply.duplicate) == (1, True)
            assert ps.describe_group("g").update_count == 1


@pytest.mark.parametrize("bad", ["nan", "shape", "dtype"])
def test_a_bad_gradient_is_refused_and_nothing_changes(
    small_chunks: ServerHandle, bad: str
) -> None:
    with Client(
        small_chunks.address, timeout=30, transport="stream", chunk_bytes=CHUNK
    ) as ps:
        ps.create_group("g", Adam(), learning_rate=0.1, tensors=_tensors(np.float32))
        ps.push("g", *_grads(np.float32, 0))
        _, before = ps.pull_versioned("g", state=True)
        grads = _grads(np.float32, 1)
        if bad == "nan":
            grads[0][123, 45] = np.nan
            match = "NaN or inf"
        elif bad == "shape":
            grads[1] = np.zeros(4, np.float32)
            match = r"must have shape \(3,\)"
        else:
            grads[2] = grads[2].astype(np.float64)
            match = "must be float32"
        with pytest.raises(InvalidArgumentError, match=match):
            ps.push("g", *grads, return_values=True)
        t, after = ps.pull_versioned("g", state=True)
        assert t == 1
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


def test_a_caller_that_leaves_mid_reply_leaves_the_server_serving(
    small_chunks: ServerHandle,
) -> None:
    grads = _grads(np.float32, 0)
    with Client(small_chunks.address, timeout=30) as ps:
        ps.create_group("g", Adam(), learning_rate=0.1, tensors=_tensors(np.float32))
        channel, stub = _stub(small_chunks)
        with channel:
            call = stub.PushPullStream(_messages("g", grads, seq=1), timeout=30)
            first = next(call)  # type: ignore[call-overload]
            assert first.header.update_count == 1
            assert next(call).WhichOneof("part") == "chunk"  # type: ignore[call-overload]
            call.cancel()  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.CANCELLED
        # The push was whole (the header is sent once it is logged and stepping);
        # the server takes the next one and answers pulls.
        values = ps.push("g", *_grads(np.float32, 1), return_values=True)
        assert ps.describe_group("g").update_count == 2
        for a, b in zip(values, ps.pull("g"), strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


def test_a_sync_push_returns_x_after_its_step(small_chunks: ServerHandle) -> None:
    with Client(
        small_chunks.address, timeout=30, transport="stream", chunk_bytes=CHUNK
    ) as ps:
        for name in ("a", "b"):
            ps.create_group(
                name,
                Momentum(alpha=0.9, beta=0.1),
                learning_rate=0.1,
                tensors=_tensors(np.float64),
                consistency=Sync(1),
            )
        grads = _grads(np.float64, 0)
        got = ps.push_detailed("a", *grads, return_values=True)
        ps.push("b", *grads)
        assert (got.update_count, got.applied) == (1, True)
        assert got.values is not None
        for a, b in zip(got.values, ps.pull("b", min_version=1), strict=True):
            np.testing.assert_array_equal(a, b, strict=True)


def test_the_async_client_streams_x_back_too(small_chunks: ServerHandle) -> None:
    grads = _grads(np.float32, 0)

    async def run() -> tuple[list[np.ndarray], list[np.ndarray]]:
        async with AsyncClient(
            small_chunks.address, timeout=30, transport="stream", chunk_bytes=CHUNK
        ) as ps:
            for name in ("a", "b"):
                await ps.create_group(
                    name,
                    Nesterov(alpha=0.9, beta=1.0),
                    learning_rate=0.1,
                    tensors=_tensors(np.float32),
                )
            got = await ps.push("a", *grads, return_values=True)
            await ps.push("b", *grads)
            return got, await ps.pull("b")

    got, want = asyncio.run(run())
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b, strict=True)


def test_a_split_group_on_a_cluster_returns_the_joined_x(
    servers: Callable[..., ServerHandle],
) -> None:
    handles = [
        servers(
            ServerConfig(
                address="127.0.0.1:0",
                durability="none",
                shard=f"{i}/3",
                chunk_bytes=CHUNK,
            )
        )
        for i in range(3)
    ]
    addresses = [h.address for h in handles]
    with Client(addresses, timeout=60, transport="stream", split_bytes=1 << 20) as ps:
        for name in ("a", "b"):
            ps.create_group(
                name, Adam(), learning_rate=0.1, tensors=_tensors(np.float32)
            )
        assert len(ps.describe_group("a").parts) > 1
        for step in range(2):
            grads = _grads(np.float32, step)
            got = ps.push("a", *grads, return_values=True)
            ps.push("b", *grads)
            for a, b in zip(got, ps.pull("b"), strict=True):
                np.testing.assert_array_equal(a, b, strict=True)


KERNEL_ATTRS: dict[str, dict[str, Any]] = {
    "Adagrad": {},
    "Momentum": {
        "alpha": 0.9,
        "beta": 0.5,
        "mode": "nesterov",
        "norm_coefficient": 0.0,
    },
    "Adam": {"norm_coefficient_post": 0.01},
}


@pytest.mark.parametrize("op", sorted(KERNEL_ATTRS))
def test_step_in_order_is_step_block_by_block(op: str) -> None:
    sizes = [600_000, 7, 300_001]
    rng = np.random.default_rng(3)
    attrs = make_attrs(op, KERNEL_ATTRS[op])
    stepper = Stepper(attrs, np.float32, sizes, block=100_000)

    def arrays() -> list[list[np.ndarray]]:
        r = np.random.default_rng(4)
        return [[r.standard_normal(n).astype(np.float32) for n in sizes] for _ in "xvh"]

    gs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    (x1, v1, h1), (x2, v2, h2) = arrays(), arrays()
    has_v, has_h = "V" in attrs.state_names, "H" in attrs.state_names
    stepper.step(0.1, 2, x1, gs, v1 if has_v else None, h1 if has_h else None)
    seen: list[tuple[int, int, int]] = []
    stepper.step_in_order(
        0.1,
        2,
        x2,
        gs,
        v2 if has_v else None,
        h2 if has_h else None,
        lambda i, a, b: seen.append((i, a, b)),
    )
    for a, b in zip(x1 + v1 + h1, x2 + v2 + h2, strict=True):
        np.testing.assert_array_equal(a, b, strict=True)
    # every element once, tensors in order and blocks in order within each
    assert seen == sorted(seen)
    for i, n in enumerate(sizes):
        ranges = [(a, b) for j, a, b in seen if j == i]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(p[1] == q[0] for p, q in zip(ranges, ranges[1:], strict=False))
