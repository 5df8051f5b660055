"""Generated malformed requests against one running server.

Every request gets its exact status code, nothing is allocated for huge declared
sizes, the server stays up, and every stored group is byte-identical afterwards. The
expected code of each case follows the documented order of checks: admission (the
in-flight budget) first, then the group lookup, then validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnxps.client import Adagrad, Adam, Client, Momentum
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

MAX_INFLIGHT = 64 << 20
MAX_GROUP = 16 << 20
ITEMSIZE = {pb.DATA_TYPE_FLOAT: 4, pb.DATA_TYPE_DOUBLE: 8, pb.DATA_TYPE_INT64: 8}
NP_DTYPE: dict[int, Any] = {
    pb.DATA_TYPE_FLOAT: np.float32,
    pb.DATA_TYPE_DOUBLE: np.float64,
}
STATES = {"adagrad": 1, "momentum": 1, "adam": 2, None: 0}


@dataclass(frozen=True)
class GroupSpec:
    dtype: pb.DataType.ValueType
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


GROUPS = {
    "h/f32": GroupSpec(pb.DATA_TYPE_FLOAT, ("w", "m"), ((3,), (2, 2))),
    "h/f64": GroupSpec(pb.DATA_TYPE_DOUBLE, ("b",), ((4,),)),
}

UNARY, CLIENT_STREAM, SERVER_STREAM, BIDI = "uu", "su", "us", "ss"
METHODS = {
    "CreateGroup": UNARY,
    "CreateGroupStream": CLIENT_STREAM,
    "DescribeGroup": UNARY,
    "ListGroups": UNARY,
    "DeleteGroup": UNARY,
    "SetLearningRate": UNARY,
    "Push": UNARY,
    "PushStream": CLIENT_STREAM,
    "PushPullStream": BIDI,
    "Pull": UNARY,
    "PullStream": SERVER_STREAM,
    "Apply": UNARY,
    "ApplyStream": BIDI,
    "JoinGroup": UNARY,
    "Heartbeat": UNARY,
    "LeaveGroup": UNARY,
    "Save": UNARY,
}


class Hostile:
    """One server, a raw channel, and the snapshot every case must leave intact."""

    def __init__(self, servers: Callable[..., ServerHandle]) -> None:
        self.handle: ServerHandle = servers(
            max_inflight_bytes=MAX_INFLIGHT, max_group_bytes=MAX_GROUP
        )
        self.client = Client(self.handle.address, timeout=10, transport="unary")
        self.channel = grpc.insecure_channel(self.handle.address)
        rng = np.random.default_rng(7)
        for name, spec in GROUPS.items():
            dt = NP_DTYPE[spec.dtype]
            tensors = [
                (n, rng.standard_normal(s).astype(dt))
                for n, s in zip(spec.names, spec.shapes, strict=True)
            ]
            opt = Adam() if spec.dtype == pb.DATA_TYPE_FLOAT else Adagrad()
            self.client.create_group(name, opt, learning_rate=0.1, tensors=tensors)
            grads = [rng.standard_normal(s).astype(dt) for s in spec.shapes]
            assert self.client.push(name, *grads) == 1
        self.before = self.snapshot()
        self.calls = 0

    def snapshot(self) -> dict[str, tuple[int, float, list[bytes]]]:
        out = {}
        for name in GROUPS:
            t, arrays = self.client.pull_versioned(name, state=True)
            lr = self.client.describe_group(name).learning_rate
            out[name] = (t, lr, [a.tobytes() for a in arrays])
        return out

    def call(self, method: str, messages: Sequence[bytes]) -> grpc.StatusCode:
        """Send serialized messages to a method; the status code it ends with."""
        self.calls += 1
        path = f"/onnxps.v1.ParameterServerService/{method}"
        kind = METHODS[method]
        try:
            if kind == UNARY:
                (msg,) = messages
                self.channel.unary_unary(path)(  # type: ignore[call-arg]
                    msg, timeout=10
                )
            elif kind == SERVER_STREAM:
                (msg,) = messages
                for _ in self.channel.unary_stream(path)(  # type: ignore[call-arg]
                    msg, timeout=10
                ):
                    pass
            elif kind == CLIENT_STREAM:
                self.channel.stream_unary(path)(  # type: ignore[call-arg]
                    iter(messages), timeout=10
                )
            else:
                for _ in self.channel.stream_stream(path)(  # type: ignore[call-arg]
                    iter(messages), timeout=10
                ):
                    pass
        except grpc.RpcError as exc:
            return exc.code()
        return OK

    def check_intact(self) -> None:
        assert self.call("ListGroups", [b""]) == OK  # still serving
        assert self.snapshot() == self.before
        assert sorted(g.name for g in self.client.list_groups()) == sorted(GROUPS)

    def close(self) -> None:
        self.channel.close()
        self.client.close()


@pytest.fixture(scope="module")
def ps(
    request: pytest.FixtureRequest, module_servers: Callable[..., ServerHandle]
) -> Iterator[Hostile]:
    h = Hostile(module_servers)
    try:
        yield h
        # the whole module sends well over 1,000 generated requests (one tier of it,
        # -m slow or -m "not slow", sends a part)
        ran = {
            item.originalname  # type: ignore[attr-defined]
            for item in request.session.items
            if item.module is request.module  # type: ignore[attr-defined]
        }
        if ran == {name for name in vars(request.module) if name.startswith("test_")}:
            assert h.calls >= 1000, h.calls
    finally:
        h.close()


def cases(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# -- strategies ------------------------------------------------------------------------
DTYPES = st.sampled_from(
    [pb.DATA_TYPE_FLOAT, pb.DATA_TYPE_DOUBLE, pb.DATA_TYPE_INT64, 0, 2, 10, 16, 12345]
)
DIM = st.integers(-2, 5) | st.sampled_from([2**20, 2**31, 2**40, 2**62])
DIMS = st.lists(DIM, max_size=4)
ODD_NAMES = (
    st.sampled_from(["", " ", "../etc", "h/", "h/f32 ", "H/F32", "\x00", "a\nb", "☃"])
    | st.text(max_size=40)
    | st.text(min_size=200, max_size=2000)
).filter(lambda s: s not in GROUPS)


def _valid_spec(t: pb.Tensor) -> bool:
    """Dims some array could have: at most 64, under 2**63 bytes (zeros aside)."""
    if t.dtype not in ITEMSIZE or any(d < 0 for d in t.dims) or len(t.dims) > 64:
        return False
    return math.prod(d for d in t.dims if d) * ITEMSIZE[t.dtype] < 2**63


def _nbytes(t: pb.Tensor) -> int:
    # as admission sizes a call: dims no array can have count nothing (refused later)
    return math.prod(t.dims) * ITEMSIZE[t.dtype] if _valid_spec(t) else 0


def _exact_len(t: pb.Tensor) -> int | None:
    n = _nbytes(t) if _valid_spec(t) else None
    return n if n is not None and n <= 256 else None


@st.composite
def tensors(draw: st.DrawFn, with_data: bool = True) -> pb.Tensor:
    dtype = pb.DataType.ValueType(draw(DTYPES))
    t = pb.Tensor(name=draw(st.text(max_size=4)), dtype=dtype)
    t.dims.extend(draw(DIMS))
    if with_data:
        exact = _exact_len(t)
        size = draw(
            st.integers(0, 64) if exact is None else st.sampled_from([exact, exact + 1])
        )
        t.raw_data = draw(st.binary(min_size=size, max_size=size))
    return t


def _right_tensor(spec: GroupSpec, i: int, values: np.ndarray) -> pb.Tensor:
    arr = np.asarray(values, NP_DTYPE[spec.dtype]).reshape(spec.shapes[i])
    return pb.Tensor(
        name=spec.names[i], dtype=spec.dtype, dims=arr.shape, raw_data=arr.tobytes()
    )


def _push_is_valid(group: str, grads: Sequence[pb.Tensor]) -> bool:
    spec = GROUPS.get(group)
    if spec is None or len(grads) != len(spec.shapes):
        return False
    for t, shape in zip(grads, spec.shapes, strict=True):
        if t.dtype != spec.dtype or tuple(t.dims) != shape:
            return False
        if len(t.raw_data) != _nbytes(t):
            return False
        a = np.frombuffer(t.raw_data, NP_DTYPE[spec.dtype])
        if not np.isfinite(a).all():
            return False
    return True


GROUP_NAMES = st.sampled_from(sorted(GROUPS)) | ODD_NAMES


# -- unary push ------------------------------------------------------------------------
@pytest.mark.slow
def test_malformed_unary_pushes(ps: Hostile) -> None:
    @cases(250)
    @given(
        group=GROUP_NAMES,
        grads=st.lists(tensors(), max_size=4),
        base=st.none() | st.integers(-(2**63), 2**63 - 1),
    )
    def run(group: str, grads: list[pb.Tensor], base: int | None) -> None:
        assume(not _push_is_valid(group, grads))
        req = pb.PushRequest(group=group, gradients=grads, client_id="h", seq=1)
        if base is not None:
            req.base_version = base
        want = NOT_FOUND if group not in GROUPS else INVALID
        assert ps.call("Push", [req.SerializeToString()]) == want

    run()
    ps.check_intact()


def test_non_finite_gradients_are_refused(ps: Hostile) -> None:
    bad = st.sampled_from([np.nan, np.inf, -np.inf])

    @cases(100)
    @given(
        group=st.sampled_from(sorted(GROUPS)),
        data=st.data(),
        stream=st.booleans(),
    )
    def run(group: str, data: st.DataObject, stream: bool) -> None:
        spec = GROUPS[group]
        grads = []
        for shape in spec.shapes:
            n = math.prod(shape)
            grads.append(
                np.array(
                    data.draw(st.lists(st.floats(-1e3, 1e3), min_size=n, max_size=n))
                )
            )
        which = data.draw(st.integers(0, len(grads) - 1))
        where = data.draw(st.integers(0, grads[which].size - 1))
        grads[which][where] = data.draw(bad)
        msgs = [_right_tensor(spec, i, g) for i, g in enumerate(grads)]
        if not stream:
            req = pb.PushRequest(group=group, gradients=msgs)
            assert ps.call("Push", [req.SerializeToString()]) == INVALID
            return
        header = pb.PushRequest(
            group=group,
            gradients=[
                pb.Tensor(name=t.name, dtype=t.dtype, dims=t.dims) for t in msgs
            ],
        )
        chunks = [pb.PushStreamRequest(header=header).SerializeToString()] + [
            pb.PushStreamRequest(
                chunk=pb.TensorChunk(index=i, offset=0, data=t.raw_data)
            ).SerializeToString()
            for i, t in enumerate(msgs)
        ]
        assert ps.call("PushStream", chunks) == INVALID

    run()
    ps.check_intact()


# -- streams ---------------------------------------------------------------------------
@st.composite
def chunk_lists(draw: st.DrawFn, n_tensors: int) -> list[pb.TensorChunk]:
    chunk = st.builds(
        pb.TensorChunk,
        index=st.integers(0, n_tensors + 1),
        offset=st.integers(0, 40) | st.sampled_from([2**40, 2**64 - 1]),
        data=st.binary(max_size=48),
    )
    return draw(st.lists(chunk, max_size=5))


def _declared(ts: Sequence[pb.Tensor]) -> int:
    return sum(_nbytes(t) for t in ts)


def _stream_push_is_valid(
    group: str, headers: Sequence[pb.Tensor], chunks: Sequence[pb.TensorChunk]
) -> bool:
    spec = GROUPS.get(group)
    if spec is None:
        return False
    filled = [b""] * len(headers)
    for c in chunks:
        if c.index >= len(headers) or c.offset != len(filled[c.index]):
            return False
        filled[c.index] += c.data
    grads = [
        pb.Tensor(dtype=h.dtype, dims=h.dims, raw_data=data)
        for h, data in zip(headers, filled, strict=True)
    ]
    return _push_is_valid(group, grads)


@pytest.mark.slow
def test_malformed_push_streams(ps: Hostile) -> None:
    @cases(200)
    @given(
        group=GROUP_NAMES,
        headers=st.lists(tensors(with_data=False), max_size=3),
        data=st.data(),
        header_first=st.integers(0, 9),
    )
    def run(
        group: str, headers: list[pb.Tensor], data: st.DataObject, header_first: int
    ) -> None:
        chunks = data.draw(chunk_lists(len(headers)))
        header = pb.PushStreamRequest(
            header=pb.PushRequest(group=group, gradients=headers)
        )
        msgs = [pb.PushStreamRequest(chunk=c) for c in chunks]
        if header_first:  # else: a stream that does not begin with its header
            msgs.insert(0, header)
        first = msgs[0] if msgs else None
        declared = 0
        if first is not None and first.WhichOneof("part") == "header":
            declared = first.ByteSize() + _declared(headers)
        if declared > MAX_INFLIGHT:
            want = EXHAUSTED
        elif not header_first:
            want = INVALID
        elif group not in GROUPS:
            want = NOT_FOUND
        else:
            assume(not _stream_push_is_valid(group, headers, chunks))
            want = INVALID
        # within the call's 10 s deadline, else it would end DEADLINE_EXCEEDED
        assert ps.call("PushStream", [m.SerializeToString() for m in msgs]) == want

    run()
    ps.check_intact()


def test_malformed_apply_streams(ps: Hostile) -> None:
    @cases(150)
    @given(
        headers=st.lists(tensors(with_data=False), min_size=0, max_size=5),
        optimizer=st.sampled_from(
            [
                pb.OptimizerSpec(),
                Adagrad().to_proto(),
                Adam().to_proto(),
                Momentum(0.9, 0.1, "standard").to_proto(),
            ]
        ),
        data=st.data(),
    )
    def run(
        headers: list[pb.Tensor], optimizer: pb.OptimizerSpec, data: st.DataObject
    ) -> None:
        chunks = data.draw(chunk_lists(len(headers)))
        # a last chunk for a tensor the header does not list: never a valid stream
        chunks.append(pb.TensorChunk(index=len(headers), offset=0, data=b"x"))
        first = pb.ApplyStreamRequest(
            request=pb.ApplyRequest(optimizer=optimizer, inputs=headers)
        )
        msgs = [first] + [pb.ApplyStreamRequest(chunk=c) for c in chunks]
        declared = first.ByteSize() + _declared(headers)
        want = EXHAUSTED if declared > MAX_INFLIGHT else INVALID
        assert ps.call("ApplyStream", [m.SerializeToString() for m in msgs]) == want

    run()
    ps.check_intact()


def test_malformed_create_group_streams(ps: Hostile) -> None:
    @cases(100)
    @given(
        name=GROUP_NAMES,
        headers=st.lists(tensors(with_data=False), max_size=3),
        state=st.lists(tensors(with_data=False), max_size=2),
        kind=st.sampled_from(["adagrad", "adam", None]),
    )
    def run(
        name: str, headers: list[pb.Tensor], state: list[pb.Tensor], kind: str | None
    ) -> None:
        opt = {"adagrad": Adagrad(), "adam": Adam(), None: None}[kind]
        req = pb.CreateGroupRequest(
            group=name,
            optimizer=opt.to_proto() if opt is not None else pb.OptimizerSpec(),
            learning_rate=0.1,
            tensors=headers,
            state=state,
        )
        first = pb.CreateGroupStreamRequest(header=req)
        bad_index = pb.TensorChunk(index=len(headers) + len(state), data=b"x")
        msgs = [first, pb.CreateGroupStreamRequest(chunk=bad_index)]
        group_bytes = _declared(headers) * (1 + STATES[kind])
        if first.ByteSize() + _declared(headers) + _declared(state) > MAX_INFLIGHT:
            want = EXHAUSTED
        elif not all(_valid_spec(t) for t in headers):
            want = INVALID
        elif group_bytes > MAX_GROUP:
            want = EXHAUSTED
        else:
            want = INVALID
        assert ps.call("CreateGroupStream", [m.SerializeToString() for m in msgs]) == (
            want
        )

    run()
    ps.check_intact()


# -- unary create and apply ------------------------------------------------------------
def _with_mismatch(data: st.DataObject, ts: list[pb.Tensor]) -> list[pb.Tensor]:
    """Make one tensor's byte length disagree with its dims: never a valid request."""
    i = data.draw(st.integers(0, len(ts) - 1))
    t = ts[i]
    want = _nbytes(t) if _valid_spec(t) else -1
    if len(t.raw_data) == want:
        t.raw_data = t.raw_data + b"\x00"
    return ts


def test_malformed_unary_creates(ps: Hostile) -> None:
    @cases(150)
    @given(
        name=GROUP_NAMES,
        ts=st.lists(tensors(), min_size=1, max_size=3),
        kind=st.sampled_from(["adagrad", "adam", "momentum", None]),
        data=st.data(),
    )
    def run(
        name: str, ts: list[pb.Tensor], kind: str | None, data: st.DataObject
    ) -> None:
        ts = _with_mismatch(data, ts)
        opt = {
            "adagrad": Adagrad().to_proto(),
            "adam": Adam().to_proto(),
            "momentum": Momentum(0.9, 0.1, "nesterov").to_proto(),
            None: pb.OptimizerSpec(),
        }[kind]
        req = pb.CreateGroupRequest(
            group=name, optimizer=opt, learning_rate=0.1, tensors=ts
        )
        if not all(_valid_spec(t) for t in ts):
            want = INVALID
        elif _declared(ts) * (1 + STATES[kind]) > MAX_GROUP:
            want = EXHAUSTED
        else:
            want = INVALID
        assert ps.call("CreateGroup", [req.SerializeToString()]) == want

    run()
    ps.check_intact()


def test_malformed_unary_applies(ps: Hostile) -> None:
    @cases(150)
    @given(ts=st.lists(tensors(), min_size=1, max_size=6), data=st.data())
    def run(ts: list[pb.Tensor], data: st.DataObject) -> None:
        ts = _with_mismatch(data, ts)
        req = pb.ApplyRequest(optimizer=Adagrad().to_proto(), inputs=ts)
        assert ps.call("Apply", [req.SerializeToString()]) == INVALID

    run()
    ps.check_intact()


# -- names -----------------------------------------------------------------------------
def test_unknown_and_odd_group_names(ps: Hostile) -> None:
    requests: dict[str, Callable[[str], Any]] = {
        "DescribeGroup": lambda g: pb.DescribeGroupRequest(group=g),
        "DeleteGroup": lambda g: pb.DeleteGroupRequest(group=g),
        "SetLearningRate": lambda g: pb.SetLearningRateRequest(
            group=g, learning_rate=1
        ),
        "Pull": lambda g: pb.PullRequest(group=g, with_state=True),
        "PullStream": lambda g: pb.PullStreamRequest(group=g, min_version=10**9),
        "JoinGroup": lambda g: pb.JoinGroupRequest(group=g, worker_id="w1"),
        "Heartbeat": lambda g: pb.HeartbeatRequest(group=g, worker_id="w1"),
        "LeaveGroup": lambda g: pb.LeaveGroupRequest(group=g, worker_id="w1"),
        "Push": lambda g: pb.PushRequest(group=g),
    }

    @cases(150)
    @given(name=ODD_NAMES, method=st.sampled_from(sorted(requests)))
    def run(name: str, method: str) -> None:
        req = requests[method](name)
        assert ps.call(method, [req.SerializeToString()]) == NOT_FOUND

    run()
    for lr in (float("nan"), float("inf"), -float("inf")):
        req = pb.SetLearningRateRequest(group="h/f32", learning_rate=lr)
        assert ps.call("SetLearningRate", [req.SerializeToString()]) == INVALID
    ps.check_intact()


# -- raw garbage -----------------------------------------------------------------------
# 0x0f is field 1 with wire type 7, which does not exist: no message parses from it.
GARBAGE = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([b"\x0f", b"\x0e", b"\x00", b"\x07", b"\xff\xff\xff\xff\xff"]),
    st.binary(max_size=256),
)


def test_raw_garbage_to_every_method(ps: Hostile) -> None:
    @cases(300)
    @given(
        method=st.sampled_from(sorted(METHODS)),
        garbage=GARBAGE,
        after_valid_header=st.booleans(),
    )
    def run(method: str, garbage: bytes, after_valid_header: bool) -> None:
        messages = [garbage]
        if after_valid_header and method in ("PushStream", "ApplyStream"):
            header: Any = (
                pb.PushStreamRequest(
                    header=pb.PushRequest(
                        group="h/f64",
                        gradients=[pb.Tensor(dtype=pb.DATA_TYPE_DOUBLE, dims=[4])],
                    )
                )
                if method == "PushStream"
                else pb.ApplyStreamRequest(request=pb.ApplyRequest())
            )
            messages.insert(0, header.SerializeToString())
        assert ps.call(method, messages) == INVALID

    run()
    ps.check_intact()


def test_huge_declared_sizes_are_refused_quickly(ps: Hostile) -> None:
    huge = pb.Tensor(name="w", dtype=pb.DATA_TYPE_FLOAT, dims=[2**40])
    huge_bytes = pb.Tensor(
        name="w", dtype=pb.DATA_TYPE_FLOAT, dims=[2**40], raw_data=b"1234"
    )
    adagrad = Adagrad().to_proto()
    cases = [
        ("Push", pb.PushRequest(group="h/f32", gradients=[huge_bytes] * 2), INVALID),
        ("Apply", pb.ApplyRequest(optimizer=adagrad, inputs=[huge_bytes]), INVALID),
        (
            "CreateGroup",
            pb.CreateGroupRequest(group="new", optimizer=adagrad, tensors=[huge_bytes]),
            EXHAUSTED,
        ),
        (
            "PushStream",
            pb.PushStreamRequest(
                header=pb.PushRequest(group="h/f32", gradients=[huge])
            ),
            EXHAUSTED,
        ),
        (
            "ApplyStream",
            pb.ApplyStreamRequest(request=pb.ApplyRequest(inputs=[huge])),
            EXHAUSTED,
        ),
        (
            "CreateGroupStream",
            pb.CreateGroupStreamRequest(
                header=pb.CreateGroupRequest(group="n", tensors=[huge])
            ),
            EXHAUSTED,
        ),
    ]
    for method, msg, want in cases:
        assert ps.call(method, [msg.SerializeToString()]) == want, method
    ps.check_intact()
