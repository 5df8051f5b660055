"""The flat form (docs/protocol.md, "The flat form"): a push or pull naming the
group's layout digest carries its tensors as ONE tensor of its elements back to
back. Through every way the client sends it (gRPC unary and streams, frames,
shared memory, the data channel) its results are bit for bit those of the
per-tensor form; a wrong digest, element count, dtype or gradient count is refused
with a precise status and the group unchanged; old clients (no layout) are served
per tensor as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _servers import _crash, details
from onnxps.client import Adam, Client, InvalidArgumentError, Momentum, Sync
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import array_to_tensor, header_tensor, tensor_to_array

Array = np.ndarray[Any, Any]

# a scalar, empty tensors, a matrix, and one large enough that every way takes it
SHAPES = [(3, 5), (), (0,), (7,), (2, 0, 3), (129, 3), (20000,)]
PATHS: dict[str, dict[str, Any]] = {
    "unary": {"transport": "unary", "data_channel": "off", "frames": "off"},
    "stream": {"transport": "stream", "data_channel": "off", "frames": "off"},
    "frames": {"data_channel": "off", "frames": "on"},
    "data channel": {"data_channel": "on", "frames": "off"},
    "shared memory": {"shared_memory": "on", "data_channel": "off", "frames": "off"},
}


def values(dtype: str, seed: int = 0) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {
        f"t{i}": np.asarray(rng.standard_normal(s)).astype(dtype)
        for i, s in enumerate(SHAPES)
    }


def grads(dtype: str, step: int) -> list[Array]:
    rng = np.random.default_rng(100 + step)
    return [np.asarray(rng.standard_normal(s) * 0.1).astype(dtype) for s in SHAPES]


def bits(a: Array) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def assert_same(got: list[Array], want: list[Array]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.shape, g.dtype) == (w.shape, w.dtype), i
        assert bits(g) == bits(w), f"array {i} differs"


@pytest.fixture
def stub(server: ServerHandle) -> Iterator[pb_grpc.ParameterServerServiceStub]:
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.ParameterServerServiceStub(ch)


def per_tensor(stub: Any, group: str, arrays: list[Array], **kw: Any) -> Any:
    """A push as a client that never sets layout sends it (inline, per tensor)."""
    req = pb.PushRequest(group=group, gradients=[array_to_tensor(a) for a in arrays])
    return stub.Push(pb.PushRequest(**kw) if not arrays else _with(req, **kw))


def _with(req: pb.PushRequest, **kw: Any) -> pb.PushRequest:
    for k, v in kw.items():
        setattr(req, k, v)
    return req


def pulled(stub: Any, group: str) -> tuple[int, list[Array]]:
    reply = stub.Pull(pb.PullRequest(group=group, with_state=True))
    return reply.update_count, [tensor_to_array(t) for t in reply.tensors]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_flat_push_and_pull_equal_the_per_tensor_ones_bit_for_bit(
    server: ServerHandle, stub: Any, path: str, dtype: str
) -> None:
    x0 = values(dtype)
    with Client(server.address, timeout=60, **PATHS[path]) as c:
        c.create_group("flat", Adam(), learning_rate=0.05, tensors=x0)
        c.create_group("ref", Adam(), learning_rate=0.05, tensors=x0)
        layout = c.describe_group("flat").layout
        assert len(layout) == 16  # the client knows the flat form
        assert c.describe_group("ref").layout == layout  # same tensors, same digest
        for step in range(3):
            g = grads(dtype, step)
            ref = per_tensor(stub, "ref", g, return_values=step == 1)
            if step == 1:
                x = c.push("flat", *g, return_values=True)
                assert_same(x, [tensor_to_array(t) for t in ref.values])
                assert [a.shape for a in x] == SHAPES
            else:
                assert c.push("flat", *g) == ref.update_count == step + 1
        got = c.pull("flat", state=True)
        t, want = pulled(stub, "ref")
        assert t == 3
        assert_same(got, want)
        assert_same(c.pull("flat"), want[: len(SHAPES)])
        out = [np.empty_like(a) for a in want[: len(SHAPES)]]
        res = c.pull("flat", out=out)
        assert all(r is o for r, o in zip(res, out, strict=True))
        assert_same(out, want[: len(SHAPES)])


def test_groups_of_large_tensors_go_per_tensor(server: ServerHandle) -> None:
    """The client uses the form where it pays: tensors averaging at most 64 KiB."""
    small = {"a": np.zeros(16384, "f4"), "b": np.zeros(16384, "f4")}  # 64 KiB each
    large = {"a": np.zeros(16385, "f4"), "b": np.zeros(16384, "f4")}
    with Client(server.address, timeout=60) as c:
        c.create_group("small", Adam(), learning_rate=0.1, tensors=small)
        c.create_group("large", Adam(), learning_rate=0.1, tensors=large)
        assert c.describe_group("large").layout  # the server offers it to both
        assert "small" in c.ops.flat_forms and "large" not in c.ops.flat_forms
        for name, x in (("small", small), ("large", large)):
            got = c.push(
                name, *[np.ones_like(a) for a in x.values()], return_values=True
            )
            assert [a.shape for a in got] == [a.shape for a in x.values()]


def flat_push(group: str, layout: bytes, flat: Array, **kw: Any) -> pb.PushRequest:
    return pb.PushRequest(
        group=group, layout=layout, gradients=[array_to_tensor(flat)], **kw
    )


def test_the_server_answers_a_flat_call_in_the_flat_form(
    server: ServerHandle, stub: Any
) -> None:
    x0 = values("float32")
    with Client(server.address, timeout=60) as c:
        info = c.create_group(
            "g", Momentum(alpha=0.9, beta=0.1), learning_rate=0.1, tensors=x0
        )
        c.create_group(
            "ref", Momentum(alpha=0.9, beta=0.1), learning_rate=0.1, tensors=x0
        )
    g = grads("float32", 0)
    flat = np.concatenate(g, axis=None)
    reply = stub.Push(flat_push("g", info.layout, flat, return_values=True))
    assert len(reply.values) == 1
    assert list(reply.values[0].dims) == [flat.size]
    per_tensor(stub, "ref", g)
    _, want = pulled(stub, "ref")
    assert bits(tensor_to_array(reply.values[0])) == bits(
        np.concatenate(want[: len(SHAPES)], axis=None)
    )
    reply = stub.Pull(pb.PullRequest(group="g", with_state=True, layout=info.layout))
    assert [t.name for t in reply.tensors] == ["X", "V"]
    assert [list(t.dims) for t in reply.tensors] == [[flat.size]] * 2
    assert bits(tensor_to_array(reply.tensors[1])) == bits(
        np.concatenate(want[len(SHAPES) :], axis=None)
    )
    # a client that never sets layout is answered per tensor, as before
    assert len(stub.Pull(pb.PullRequest(group="g")).tensors) == len(SHAPES)


def test_a_wrong_flat_call_is_refused_with_the_group_unchanged(
    server: ServerHandle, stub: Any
) -> None:
    x0 = values("float32")
    with Client(server.address, timeout=60) as c:
        layout = c.create_group("g", Adam(), learning_rate=0.1, tensors=x0).layout
        c.create_group(
            "one", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4, "f4")}
        )
    before = pulled(stub, "g")
    flat = np.concatenate(grads("float32", 0), axis=None)
    other = bytes(16 - len(b"other")) + b"other"

    code, info, fields = details(lambda: stub.Push(flat_push("g", other, flat)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.reason == "LAYOUT_MISMATCH" and fields == []
    assert info.metadata["expected"] == layout.hex()
    assert info.metadata["received"] == other.hex()
    code, info, _ = details(lambda: stub.Pull(pb.PullRequest(group="g", layout=other)))
    assert (code, info.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "LAYOUT_MISMATCH",
    )
    code, info, _ = details(
        lambda: stub.Push(flat_push("one", layout, np.zeros(4, "f4")))
    )
    assert info.reason == "LAYOUT_MISMATCH" and info.metadata["expected"] == ""

    code, info, fields = details(lambda: stub.Push(flat_push("g", layout, flat[1:])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "SHAPE_MISMATCH" and fields == ["gradients[0].dims"]
    assert info.metadata["expected"] == str((flat.size,))
    code, info, fields = details(
        lambda: stub.Push(flat_push("g", layout, flat.astype("f8")))
    )
    assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "DTYPE_MISMATCH")
    assert fields == ["gradients[0].dtype"]
    two = pb.PushRequest(
        group="g", layout=layout, gradients=[array_to_tensor(flat)] * 2
    )
    code, info, fields = details(lambda: stub.Push(two))
    assert (code, info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "GRADIENT_COUNT")

    t, arrays = pulled(stub, "g")
    assert t == before[0] == 0
    assert_same(arrays, before[1])


def test_a_client_whose_group_was_created_again_falls_back_per_tensor(
    server: ServerHandle,
) -> None:
    with Client(server.address, timeout=60) as a, Client(server.address) as b:
        a.create_group("g", Adam(), learning_rate=0.1, tensors=values("float32"))
        old = a.describe_group("g").layout
        b.delete_group("g")
        shapes = {"u": np.ones((2, 2), "f4"), "v": np.ones(3, "f4")}
        new = b.create_group("g", Adam(), learning_rate=0.1, tensors=shapes).layout
        assert new != old
        # a still holds the old layout: its push is refused, then sent per tensor
        x = a.push("g", np.ones((2, 2), "f4"), np.ones(3, "f4"), return_values=True)
        assert [v.shape for v in x] == [(2, 2), (3,)]
        assert_same(a.pull("g"), b.pull("g"))
        assert a.describe_group("g").layout == new
        assert a.push("g", np.ones((2, 2), "f4"), np.ones(3, "f4")) == 2


def test_a_flat_stream_of_wrong_chunks_is_refused_with_the_group_unchanged(
    server: ServerHandle, stub: Any
) -> None:
    """A flat PushStream or PushPullStream whose chunks are out of order,
    overlapping, short, too long or of another tensor is INVALID_ARGUMENT, as a
    per-tensor one is, and nothing is stepped."""
    x0 = {"a": np.ones((2, 3), "f4"), "b": np.ones(4, "f4")}
    with Client(server.address, timeout=60) as c:
        layout = c.create_group("g", Adam(), learning_rate=0.1, tensors=x0).layout
    before = pulled(stub, "g")
    g = np.arange(10, dtype="f4")
    raw = g.tobytes()

    def header(**kw: Any) -> pb.PushStreamRequest:
        req = pb.PushRequest(
            group="g", layout=layout, gradients=[header_tensor(g)], **kw
        )
        return pb.PushStreamRequest(header=req)

    def chunk(index: int, offset: int, data: bytes) -> pb.PushStreamRequest:
        return pb.PushStreamRequest(
            chunk=pb.TensorChunk(index=index, offset=offset, data=data)
        )

    wrong = {
        "out of order": [chunk(0, 20, raw[20:]), chunk(0, 0, raw[:20])],
        "short": [chunk(0, 0, raw[:36])],
        "overlapping": [chunk(0, 0, raw[:24]), chunk(0, 20, raw[20:])],
        "another tensor": [chunk(1, 0, raw)],
        "too long": [chunk(0, 0, raw), chunk(0, 40, bytes(4))],
        "none": [],
    }
    for what, chunks in wrong.items():
        for call in (
            lambda chunks=chunks: stub.PushStream(
                iter([header(), *chunks]), timeout=10
            ),
            lambda chunks=chunks: list(
                stub.PushPullStream(
                    iter([header(return_values=True), *chunks]), timeout=10
                )
            ),
        ):
            code, info, _ = details(call)
            assert (code, info.reason) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_TENSOR",
            ), what
    t, arrays = pulled(stub, "g")
    assert t == before[0] == 0
    assert_same(arrays, before[1])
    # the same header with its chunks in order steps
    done = stub.PushStream(iter([header(), chunk(0, 0, raw)]), timeout=10)
    assert done.update_count == 1


def test_a_flat_call_outside_the_tokens_prefixes_learns_nothing_of_the_layout(
    servers: Any, tmp_path: Any
) -> None:
    """The token's group check comes first: a flat call with a wrong digest on a
    group the token may not touch is PERMISSION_DENIED, never LAYOUT_MISMATCH
    (whose metadata names the group's digest)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("adm admin *\nta write team-a/\nrb read team-b/\n")
    handle = servers(tokens_file=str(tokens))
    x0 = {"a": np.ones((2, 3), "f4"), "b": np.ones(4, "f4")}
    with Client(handle.address, timeout=60, token="adm") as c:
        layout = c.create_group("team-b/g", Adam(), learning_rate=0.1, tensors=x0)
    other = bytes(16)
    assert layout.layout != other
    flat = array_to_tensor(np.ones(10, "f4"))
    push = pb.PushRequest(group="team-b/g", layout=other, gradients=[flat])
    header = pb.PushRequest(
        group="team-b/g", layout=other, gradients=[header_tensor(np.ones(10, "f4"))]
    )

    def calls_of(s: Any, token: str) -> list[Callable[[], Any]]:
        md = [("authorization", f"Bearer {token}")]
        pulls: list[Callable[[], Any]] = [
            lambda: s.Pull(pb.PullRequest(group="team-b/g", layout=other), metadata=md),
            lambda: list(
                s.PullStream(
                    pb.PullStreamRequest(group="team-b/g", layout=other), metadata=md
                )
            ),
        ]
        if token != "ta":  # a read token is refused pushes for its role
            return pulls
        return [
            *pulls,
            lambda: s.Push(push, metadata=md),
            lambda: s.PushStream(
                iter([pb.PushStreamRequest(header=header)]), metadata=md
            ),
        ]

    with grpc.insecure_channel(handle.address) as ch:
        s = pb_grpc.ParameterServerServiceStub(ch)
        for call in calls_of(s, "rb"):  # rb may read team-b/: the digest is checked
            assert details(call)[1].reason == "LAYOUT_MISMATCH"
        for call in calls_of(s, "ta"):
            code, info, _ = details(call)
            assert (code, info.reason) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "GROUP_NOT_PERMITTED",
            )
            assert "expected" not in info.metadata
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert layout.layout.hex() not in (err.value.details() or "")


def test_a_flat_push_is_logged_per_tensor_and_replays_to_the_same_x(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    """The server makes a flat push's per-tensor views only where they are read:
    a WAL record reads them, so the log replays the pushes bit for bit."""
    config = ServerConfig(
        address="127.0.0.1:0",
        durability="wal",
        data_dir=str(tmp_path),
        snapshot_interval=0,
    )
    first = servers(config)
    try:
        with Client(first.address, timeout=60) as c:
            c.create_group("g", Adam(), learning_rate=0.05, tensors=values("float32"))
            assert "g" in c.ops.flat_forms
            for step in range(3):
                c.push("g", *grads("float32", step))
            before = c.pull("g", state=True)
    finally:
        _crash(first)
    second = servers(config)
    with Client(second.address, timeout=60) as c:
        assert c.describe_group("g").update_count == 3
        assert_same(c.pull("g", state=True), before)


def test_a_flat_push_to_a_sync_group_steps_as_the_per_tensor_one(
    server: ServerHandle, stub: Any
) -> None:
    """A sync round buffers a flat push's gradients per tensor."""
    x0 = values("float32")
    with Client(server.address, timeout=60) as c:
        for name in ("flat", "ref"):
            c.create_group(
                name,
                Adam(),
                learning_rate=0.05,
                tensors=x0,
                consistency=Sync(workers=1),
            )
        assert "flat" in c.ops.flat_forms
        for step in range(2):
            g = grads("float32", step)
            per_tensor(stub, "ref", g, client_id="ref-worker", seq=step + 1)
            assert c.push("flat", *g) == step + 1
        t, want = pulled(stub, "ref")
        assert t == 2
        assert_same(c.pull("flat", state=True), want)


def test_a_non_finite_flat_gradient_is_refused_naming_its_tensor(
    server: ServerHandle,
) -> None:
    with Client(server.address, timeout=60) as c:
        c.create_group("g", Adam(), learning_rate=0.05, tensors=values("float32"))
        assert "g" in c.ops.flat_forms
        g = grads("float32", 0)
        g[5][1, 2] = np.nan  # "t5", of shape (129, 3)
        with pytest.raises(InvalidArgumentError) as got:
            c.push("g", *g)
        assert got.value.reason == "NON_FINITE_GRADIENT"
        assert "gradient 6 ('t5') holds NaN or inf" in str(got.value)
        assert c.describe_group("g").update_count == 0
