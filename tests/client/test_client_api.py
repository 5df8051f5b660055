"""The client library: exports, lifecycle, deadlines, exceptions, group info."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxps.client
import pytest
from deadlines import resend_pauses, waited_for
from onnxps.client import (
    Adagrad,
    Adam,
    Async,
    Client,
    ClientClosedError,
    DeadlineExceededError,
    FailedPreconditionError,
    GroupInfo,
    LeaseInfo,
    Momentum,
    NotFoundError,
    OnnxpsError,
    RpcError,
    SaveInfo,
    Sync,
    UnavailableError,
)
from onnxps.client._errors import translate
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    TensorAssembler,
    array_to_tensor,
    chunk_messages,
    header_tensor,
    iter_chunks,
    tensor_to_array,
)

X = np.zeros(3, np.float32)

# Every public call, as it would be made by a worker.
CALLS: dict[str, Callable[..., Any]] = {
    "create_group": lambda c, **kw: c.create_group(
        "g", Adagrad(), learning_rate=0.1, tensors={"x": X}, **kw
    ),
    "describe_group": lambda c, **kw: c.describe_group("g", **kw),
    "list_groups": lambda c, **kw: c.list_groups(**kw),
    "delete_group": lambda c, **kw: c.delete_group("g", **kw),
    "set_learning_rate": lambda c, **kw: c.set_learning_rate("g", 0.5, **kw),
    "push": lambda c, **kw: c.push("g", X, **kw),
    "push_detailed": lambda c, **kw: c.push_detailed("g", X, **kw),
    "push_background": lambda c, **kw: c.push_background("g", X, **kw).result(),
    "pull": lambda c, **kw: c.pull("g", **kw),
    "pull_versioned": lambda c, **kw: c.pull_versioned("g", state=True, **kw),
    "push_rows": lambda c, **kw: c.push_rows("g", {"x": ([0], X[:1])}, **kw),
    "pull_rows": lambda c, **kw: c.pull_rows("g", {"x": [0, 2]}, **kw),
    "list_rows": lambda c, **kw: c.list_rows("g", "emb", **kw),
    "count_rows": lambda c, **kw: c.count_rows("g", "emb", **kw),
    "export_rows": lambda c, **kw: c.export_rows("g", "emb", **kw),
    "apply": lambda c, **kw: c.apply(Adagrad(), np.float32(0.1), 0, X, X, X, **kw),
    "join": lambda c, **kw: c.join("g", **kw),
    "leave": lambda c, **kw: c.leave("g", **kw),
    "save": lambda c, **kw: c.save(**kw),
    "rewind": lambda c, **kw: c.rewind("g", to_step=0, **kw),
    "fork": lambda c, **kw: c.fork("g", "g2", at_step=0, **kw),
    "history": lambda c, **kw: c.history("g", **kw),
    "tensor_buffers": lambda c, **kw: c.tensor_buffers("g", **kw),
}


# Made of several calls, each with the client's default deadline: no timeout=.
COMPOSITE: dict[str, Callable[..., Any]] = {
    "export": lambda c, path: c.export(path),
    "import_": lambda c, path: c.import_(path),
}


# -- exports (httpx's test) ------------------------------------------------------------


def test_all_lists_every_public_class_and_function() -> None:
    public = {
        name
        for name, value in vars(onnxps.client).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__.startswith("onnxps.client")
    }
    assert public <= set(onnxps.client.__all__), public - set(onnxps.client.__all__)
    assert onnxps.client.__all__ == sorted(set(onnxps.client.__all__))
    for name in onnxps.client.__all__:
        assert hasattr(onnxps.client, name), name
    # the exception tree is exported whole
    errors = {
        cls.__name__
        for cls in vars(onnxps.client).values()
        if inspect.isclass(cls) and issubclass(cls, OnnxpsError)
    }
    # with TensorFormatError, ExportFileError, EncodingRangeError, SharedMemoryError,
    # DataChannelError, PartsDivergedError
    assert len(errors) == 19
    assert errors <= set(onnxps.client.__all__)


def test_every_public_call_is_in_the_table_below() -> None:
    methods = {
        name
        for name, value in vars(Client).items()
        if not name.startswith("_") and inspect.isfunction(value) and name != "close"
    }
    assert methods == set(CALLS) | set(COMPOSITE)
    for name in CALLS:
        assert "timeout" in inspect.signature(getattr(Client, name)).parameters, name


# -- lifecycle -------------------------------------------------------------------------


def test_context_manager_closes_and_refuses_reuse(server: ServerHandle) -> None:
    with Client(server.address, timeout=10) as c:
        assert c.list_groups() == []
    with pytest.raises(ClientClosedError, match="closed; create a new Client"):
        c.list_groups()
    with pytest.raises(ClientClosedError), c:
        pass
    c.close()  # idempotent
    assert issubclass(ClientClosedError, OnnxpsError)
    assert not issubclass(ClientClosedError, RpcError)


@pytest.mark.parametrize("name", list(CALLS))
def test_every_call_after_close_raises_client_closed(
    server: ServerHandle, name: str
) -> None:
    c = Client(server.address, timeout=10)
    c.close()  # before the channel was ever opened
    with pytest.raises(ClientClosedError):
        CALLS[name](c)


@pytest.mark.parametrize("name", list(COMPOSITE))
def test_composite_calls_after_close_raise_client_closed(
    server: ServerHandle, client: Client, name: str, tmp_path: Any
) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
    client.export(tmp_path / "groups")  # a valid file for import_
    c = Client(server.address, timeout=10)
    c.close()
    with pytest.raises(ClientClosedError):
        COMPOSITE[name](c, tmp_path / "groups")


def test_channel_opens_on_first_use() -> None:
    c = Client("127.0.0.1:1", timeout=1)  # nothing listens there: no error yet
    assert c._channels == {}
    c.close()


def test_use_after_close_with_open_channel(client: Client) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
    client.close()
    for call in CALLS.values():
        with pytest.raises(ClientClosedError):
            call(client)


# -- deadlines -------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_pull_min_version_honours_timeout(server: ServerHandle, transport: str) -> None:
    with Client(server.address, timeout=30, transport=transport) as c:  # type: ignore[arg-type]
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
        t = c.push("g", X)
        with pytest.raises(DeadlineExceededError) as info:
            c.pull("g", min_version=t + 5, timeout=0.3)
    assert waited_for(info.value.details) == 0.3  # its own deadline, not the 30 s
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(info.value, TimeoutError)


def test_pull_min_version_uses_default_timeout(server: ServerHandle) -> None:
    with Client(server.address, timeout=0.3) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
        with pytest.raises(DeadlineExceededError) as info:
            c.pull_versioned("g", min_version=1)
        assert waited_for(info.value.details) == 0.3


def test_pull_min_version_returns_when_reached(client: Client) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
    timer = threading.Timer(0.2, lambda: client.push("g", np.ones(3, np.float32)))
    timer.start()
    try:
        t, (x,) = client.pull_versioned("g", min_version=1, timeout=10)
    finally:
        timer.join()
    assert t == 1
    assert not np.array_equal(x, X)


STREAMED = ("create_group", "push", "pull_versioned", "apply")


@pytest.mark.parametrize(
    ("name", "transport"),
    [(n, "unary") for n in CALLS] + [(n, "stream") for n in STREAMED],
)
def test_every_call_honours_timeout(
    silent_address: str, name: str, transport: str
) -> None:
    with Client(
        silent_address,
        timeout=60,
        transport=transport,  # type: ignore[arg-type]
    ) as c:
        with pytest.raises(DeadlineExceededError) as info:
            CALLS[name](c, timeout=0.2)
    # The call's own deadline, not the client's 60 s (a call made of several RPCs
    # gives the later ones what is left of it).
    assert 0 < waited_for(info.value.details) <= 0.2


def test_default_timeout_applies_to_every_call(silent_address: str) -> None:
    with Client(silent_address, timeout=0.1) as c:
        for name, call in CALLS.items():
            with pytest.raises(DeadlineExceededError) as info:
                call(c)
            assert 0 < waited_for(info.value.details) <= 0.1, name


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_one_deadline_covers_every_send_of_a_push(
    silent_address: str, transport: str
) -> None:
    # A server that never answers: the push ends after its 1 s, not after a multiple
    # of it, and says what it waited for.
    with Client(silent_address, timeout=60, transport=transport) as c:  # type: ignore[arg-type]
        with pytest.raises(DeadlineExceededError) as info:
            c.push("g", X, timeout=1.0)
    assert re.fullmatch(
        r"the push to group g \(seq \d+\) was not answered within 1 s",
        info.value.details,
    )


def test_a_push_to_a_closed_port_ends_within_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens: every send is UNAVAILABLE
    caplog.set_level(logging.INFO, logger="onnxps.client")
    with Client(address, timeout=60) as c:
        with pytest.raises((UnavailableError, DeadlineExceededError)) as info:
            c.push("g", X, timeout=1.0)
    if isinstance(info.value, UnavailableError):
        assert "stayed unavailable for 1 s" in str(info.value)
    else:
        assert waited_for(info.value.details) <= 1.0
    # Any resends wait within the deadline, never past it.
    assert sum(resend_pauses(caplog.records)) <= 1.0


def test_pull_min_version_says_what_it_waited_for(client: Client) -> None:
    client.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
    with pytest.raises(DeadlineExceededError) as info:
        client.pull("g", min_version=5, timeout=0.3)
    assert info.value.details.startswith("group g did not reach T=5 within 0.3 s")


def test_return_types(servers: Callable[..., ServerHandle], tmp_path: Path) -> None:
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="snapshot",
            data_dir=str(tmp_path / "data"),
            snapshot_interval=0,
        )
    )
    with Client(handle.address, timeout=10) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"x": X})
        t = c.push("g", X)
        assert type(t) is int and t == 1
        values = c.push("g", X, return_values=True)
        assert isinstance(values, list) and len(values) == 1
        assert isinstance(values[0], np.ndarray) and values[0].shape == X.shape
        lease = c.join("g")
        assert lease == LeaseInfo(
            lease_seconds=lease.lease_seconds,
            update_count=2,
            live_workers=1,
            quorum=0,
        )
        assert lease.lease_seconds > 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            lease.quorum = 3  # type: ignore[misc]
        left = c.leave("g")
        assert isinstance(left, LeaseInfo) and left.live_workers == 0
        saved = c.save()
        assert isinstance(saved, SaveInfo)
        assert saved.groups == 1
        assert saved.path.startswith(str(tmp_path / "data")) and saved.bytes > 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            saved.groups = 2  # type: ignore[misc]


# -- exceptions ------------------------------------------------------------------------


def test_each_exception_class_carries_its_status_code() -> None:
    for cls in (c for c in vars(onnxps.client).values() if inspect.isclass(c)):
        if issubclass(cls, RpcError) and RpcError in cls.__bases__:
            words = cls.__name__.removesuffix("Error")
            expected = "".join(f"_{ch}" if ch.isupper() else ch for ch in words)
            assert cls.code.name == expected.lstrip("_").upper(), cls
    # a refinement of one code's class carries that code
    assert onnxps.client.PartsDivergedError.code == grpc.StatusCode.FAILED_PRECONDITION


class _FakeCall(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_translate_maps_codes_and_keeps_unknown_ones() -> None:
    err = translate(_FakeCall(grpc.StatusCode.NOT_FOUND, "no group named 'x'"))
    assert type(err) is NotFoundError and isinstance(err, LookupError)
    assert str(err) == "NOT_FOUND: no group named 'x'"
    other = translate(_FakeCall(grpc.StatusCode.ABORTED, "aborted"))
    assert type(other) is RpcError and other.code == grpc.StatusCode.ABORTED


def test_save_without_data_directory_fails_fast(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(FailedPreconditionError, match="--durability none"):
        client.save()
    assert not any("resend" in r.getMessage() for r in caplog.records)  # not retried


# -- group information -----------------------------------------------------------------


def test_group_info_describes_the_group(client: Client) -> None:
    info = client.create_group(
        "mlp/layer1",
        Adam(alpha=0.8),
        learning_rate=0.01,
        tensors=[("w", np.zeros((2, 5))), ("b", np.zeros(5)), ("s", np.float64(0))],
    )
    assert isinstance(info, GroupInfo)
    assert info.name == "mlp/layer1"
    # every attribute filled in, as ONNX stores it (float32)
    assert info.optimizer == Adam(
        float(np.float32(0.8)), float(np.float32(0.999)), float(np.float32(1e-6)),
        0.0, 0.0,
    )  # fmt: skip
    assert info.learning_rate == 0.01
    assert info.update_count == 0
    assert info.dtype == np.dtype(np.float64)
    assert info.tensors == [("w", (2, 5)), ("b", (5,)), ("s", ())]
    assert info.consistency == Async(None)
    assert info.allow_non_finite is False
    assert info.element_count == 16
    assert info.nbytes == 128
    assert info.state_bytes == 3 * 128  # X, V, H
    assert client.describe_group("mlp/layer1") == info

    client.create_group(
        "mlp/layer2",
        Momentum(0.9, 0.5, "nesterov", 0.0),
        learning_rate=0.1,
        tensors={"w": np.zeros(4, np.float32)},
        consistency=Sync(3, "sum"),
    )
    client.create_group("other", Adagrad(), learning_rate=1.0, tensors={"x": X})
    names = [g.name for g in client.list_groups("mlp/")]
    assert names == ["mlp/layer1", "mlp/layer2"]
    layer2 = client.list_groups("mlp/layer2")[0]
    assert layer2.consistency == Sync(3, "sum")
    assert layer2.optimizer == Momentum(float(np.float32(0.9)), 0.5, "nesterov", 0.0)
    assert layer2.quorum == 3
    assert client.delete_group("other") is True
    assert [g.name for g in client.list_groups()] == ["mlp/layer1", "mlp/layer2"]
    with pytest.raises(NotFoundError):
        client.describe_group("other")


def test_push_detailed_and_return_values(client: Client) -> None:
    client.create_group("g", Adagrad(), learning_rate=0.5, tensors={"x": X})
    result = client.push_detailed("g", np.ones(3, np.float32), return_values=True)
    assert result.update_count == 1 and result.applied and not result.duplicate
    assert result.values is not None
    (x,) = result.values
    assert x.dtype == np.float32 and x.shape == (3,)
    assert x.flags.writeable
    (pulled,) = client.pull("g")
    assert pulled.tobytes() == x.tobytes()
    assert pulled.flags.writeable


# -- the codec -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.arange(2500, dtype=np.float32).reshape(50, 50),
        np.float64(3.5),
        np.zeros((3, 0), np.float32),
        np.arange(7, dtype=">f8"),  # big-endian in memory: little-endian on the wire
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:3],  # not contiguous
    ],
    ids=["2d", "0d", "empty", "big-endian", "strided"],
)
def test_codec_round_trip_and_chunk_messages(array: Any) -> None:
    expected = np.asarray(array, dtype=np.asarray(array).dtype.newbyteorder("<"))
    msg = array_to_tensor(array, "t")
    assert msg.name == "t" and list(msg.dims) == list(np.shape(array))
    assert msg.raw_data == np.ascontiguousarray(expected).tobytes()
    decoded = tensor_to_array(pb.Tensor.FromString(msg.SerializeToString()))
    assert decoded.tobytes() == msg.raw_data and decoded.shape == np.shape(array)

    # chunks filled inside the stream message are the nested TensorChunks
    nested = [
        pb.PushStreamRequest(chunk=c).SerializeToString()
        for c in iter_chunks([array], 64)
    ]
    wire = [
        m.SerializeToString() for m in chunk_messages(pb.PushStreamRequest, [array], 64)
    ]
    assert wire == nested
    asm = TensorAssembler([header_tensor(array)], ["t"])
    for raw in wire:
        asm.add(pb.PushStreamRequest.FromString(raw).chunk)
    (out,) = asm.finish()
    assert out.tobytes() == msg.raw_data and out.shape == np.shape(array)
