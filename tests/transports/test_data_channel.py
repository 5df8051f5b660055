"""The data channel: tensor bytes on a TCP socket beside gRPC (``--data-port``).

Every result equals the gRPC path's, bit for bit; every refusal is the status the
gRPC path gives (or a data channel reason), the stored state unchanged and the
server serving on; a broken channel is closed and a push falls back to gRPC with
its seq. Real servers on 127.0.0.1 port 0 (in-process, and a killed client
process), raw sockets for what a well-behaved client never sends.
"""

from __future__ import annotations

import logging
import secrets
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    DataChannelError,
    Encoding,
    FailedPreconditionError,
    InvalidArgumentError,
    Momentum,
    Nesterov,
)
from onnxps.client._settings import multicallable
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import header_tensor

RNG = np.random.default_rng(23)
OPTIMIZERS = [Adam(), Momentum(0.9, 1.0), Nesterov(0.9, 0.9), Adagrad()]


@pytest.fixture
def server(servers: Callable[..., ServerHandle]) -> Iterator[ServerHandle]:
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", data_port=0)
    )
    yield handle


def _calls(handle: ServerHandle) -> int:
    assert handle.data_channels is not None
    return handle.data_channels.calls


def _open(handle: ServerHandle) -> int:
    assert handle.data_channels is not None
    return handle.data_channels.open_channels


def _until(check: Any, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, strict=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_every_call_on_the_channel_equals_the_grpc_path(
    server: ServerHandle, optimizer: Any, dtype: Any
) -> None:
    x0 = [RNG.standard_normal(s).astype(dtype) for s in [(300, 500), (7,), (2, 3)]]
    grads = [[RNG.standard_normal(x.shape).astype(dtype) for x in x0] for _ in range(3)]
    with (
        Client(server.address, data_channel="on", shared_memory="off") as dc,
        Client(server.address, data_channel="off", shared_memory="off") as ref,
    ):
        for c, name in ((dc, "dc"), (ref, "ref")):
            c.create_group(
                name, optimizer, learning_rate=0.05,
                tensors=[(f"x{i}", x) for i, x in enumerate(x0)],
            )  # fmt: skip
        before = _calls(server)
        for k, g in enumerate(grads):
            if k == 1:
                _same(
                    dc.push("dc", *g, return_values=True),
                    ref.push("ref", *g, return_values=True),
                )
            else:
                assert dc.push("dc", *g, base_version=k) == ref.push("ref", *g) == k + 1
            _same(dc.pull("dc"), ref.pull("ref"))
        _same(dc.pull("dc", state=True), ref.pull("ref", state=True))
        out = [np.empty_like(x) for x in x0]
        got = dc.pull("dc", out=out)
        assert all(a is b for a, b in zip(got, out, strict=True))
        _same(out, ref.pull("ref"))
        assert _calls(server) - before == 8  # every push and pull of dc
        assert _open(server) == 1  # one channel, reused call after call


def test_auto_uses_the_channel_for_large_calls_only(server: ServerHandle) -> None:
    with Client(server.address, shared_memory="off") as c:
        c.create_group(
            "big", Adam(), learning_rate=0.01, tensors={"w": np.zeros(1 << 19)}
        )
        c.create_group("small", Adam(), learning_rate=0.01, tensors={"w": np.zeros(9)})
        c.push("small", np.ones(9))
        assert _calls(server) == 0
        c.push("big", np.ones(1 << 19))  # 4 MiB of float64
        c.pull("big")
        assert _calls(server) == 2


def test_a_server_without_a_data_port_falls_back_or_refuses(
    servers: Callable[..., ServerHandle],
    caplog: pytest.LogCaptureFixture,
) -> None:
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", data_port="off")
    )
    x = np.zeros(1 << 19, np.float32)
    with Client(handle.address, shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        with caplog.at_level(logging.INFO, logger="onnxps.client"):
            assert c.push("g", np.ones_like(x)) == 1
            assert c.push("g", np.ones_like(x)) == 2
        said = [r.getMessage() for r in caplog.records if "data channel" in r.message]
        assert len(said) == 1  # said once
        assert "DATA_CHANNEL_OFF" in said[0] or "--data-port" in said[0]
    with (
        Client(handle.address, shared_memory="off", data_channel="on") as c,
        pytest.raises(DataChannelError, match="serves no data channel"),
    ):
        c.push("g", np.ones_like(x))
    with Client(handle.address) as c:
        assert c.describe_group("g").update_count == 2


def test_an_unreachable_data_port_falls_back_to_grpc(server: ServerHandle) -> None:
    assert server.data_channels is not None
    server.data_channels._listener.close()  # the port now refuses connections
    x = np.zeros(1 << 19, np.float32)
    with Client(server.address, shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        assert c.push("g", np.ones_like(x)) == 1
        assert c.pull("g")[0].shape == x.shape
    with (
        Client(server.address, shared_memory="off", data_channel="on") as c,
        pytest.raises(DataChannelError, match="cannot connect to its port"),
    ):
        c.push("g", np.ones_like(x))


# -- refusals: the gRPC path's statuses, the state unchanged --------------------------
def test_bad_gradients_get_the_grpc_paths_status_and_change_nothing(
    server: ServerHandle,
) -> None:
    x = RNG.standard_normal((512, 512)).astype(np.float32)
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        g = np.ones_like(x)
        g[300, 7] = np.nan
        with pytest.raises(InvalidArgumentError) as nan:
            c.push("g", g)
        assert nan.value.reason == "NON_FINITE_GRADIENT"
        with pytest.raises(InvalidArgumentError, match="shape"):
            c.push("g", np.ones((512, 511), np.float32))
        with pytest.raises(InvalidArgumentError, match="dtype"):
            c.push("g", np.ones((512, 512), np.float64))
        with pytest.raises(InvalidArgumentError, match="1 tensor"):
            c.push("g", np.ones_like(x), np.ones_like(x))
        assert c.describe_group("g").update_count == 0
        np.testing.assert_array_equal(c.pull("g")[0], x)
        assert c.push("g", np.ones_like(x)) == 1  # a new channel: serving on


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["bfloat16", "float16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encoded_pushes_on_the_channel_equal_the_grpc_path(
    server: ServerHandle, encoding: Encoding, dtype: Any
) -> None:
    # 1.5M elements: the widening runs over several 2M-element staging blocks
    # only for the first tensor; the rest are smaller than one
    x0 = [RNG.standard_normal(s).astype(dtype) for s in [(1500, 1000), (7,), ()]]
    grads = [[RNG.standard_normal(x.shape).astype(dtype) for x in x0] for _ in range(3)]
    with (
        Client(server.address, data_channel="on", shared_memory="off") as dc,
        Client(server.address, data_channel="off", shared_memory="off") as ref,
    ):
        for c, name in ((dc, "dc"), (ref, "ref")):
            c.create_group(
                name, Adam(), learning_rate=0.05,
                tensors=[(f"x{i}", x) for i, x in enumerate(x0)],
            )  # fmt: skip
        before = _calls(server)
        for k, g in enumerate(grads):
            if k == 1:
                _same(
                    dc.push("dc", *g, return_values=True, encoding=encoding),
                    ref.push("ref", *g, return_values=True, encoding=encoding),
                )
            else:
                assert dc.push("dc", *g, encoding=encoding) == k + 1
                assert ref.push("ref", *g, encoding=encoding) == k + 1
        _same(dc.pull("dc", state=True), ref.pull("ref", state=True))
        _same(dc.pull("dc", encoding=encoding), ref.pull("ref", encoding=encoding))
        out = [np.full_like(x, np.nan) for x in x0]
        got = dc.pull("dc", encoding=encoding, out=out)
        assert all(a is b for a, b in zip(got, out, strict=True))
        _same(out, ref.pull("ref", encoding=encoding))
        # the channel's encoded X is X rounded to the encoding (ml_dtypes)
        if dtype is np.float32:
            _same(out, [_rounded(a, encoding) for a in ref.pull("ref")])
        assert _calls(server) - before == 6  # the 3 pushes and 3 pulls of dc
    if dtype is np.float64:
        return  # float64 rounds through float32 by round-to-odd: test_encoding_codec
    # and the widened gradient is exactly what a native push of it steps
    with Client(server.address, data_channel="off", shared_memory="off") as c:
        c.create_group(
            "native", Adam(), learning_rate=0.05,
            tensors=[(f"x{i}", x) for i, x in enumerate(x0)],
        )  # fmt: skip
        for g in grads:
            c.push("native", *[_rounded(a, encoding) for a in g])
        _same(c.pull("native", state=True), c.pull("dc", state=True))


def _rounded(a: np.ndarray, encoding: str) -> np.ndarray:
    """float32 ``a`` rounded to ``encoding`` and widened back (ml_dtypes,
    independent of onnxps's codec)."""
    import ml_dtypes

    narrow = ml_dtypes.bfloat16 if encoding == "bfloat16" else np.float16
    return np.asarray(a.astype(narrow).astype(np.float32))


def test_an_encoded_nan_on_the_channel_is_refused_and_changes_nothing(
    server: ServerHandle,
) -> None:
    x = RNG.standard_normal((1024, 1024)).astype(np.float32)
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        g = np.ones_like(x)
        g[1000, 3] = np.nan  # in the last staging block
        with pytest.raises(InvalidArgumentError) as nan:
            c.push("g", g, encoding="bfloat16")
        assert nan.value.reason == "NON_FINITE_GRADIENT"
        assert c.describe_group("g").update_count == 0
        np.testing.assert_array_equal(c.pull("g")[0], x)
        assert c.push("g", np.ones_like(x), encoding="float16") == 1


def test_an_encoded_pull_out_of_range_on_the_channel_is_refused(
    server: ServerHandle,
) -> None:
    x = np.zeros(3 << 19, np.float64)
    # far beyond float16 and bfloat16, in the third block the server encodes: met
    # once the frame is under way
    x[(2 << 19) + 5] = 1e300
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        before = _calls(server)
        for encoding in ("float16", "bfloat16"):
            with pytest.raises(FailedPreconditionError) as info:
                c.pull("g", encoding=encoding)
            assert info.value.reason == "OUT_OF_ENCODING_RANGE"
            assert f"cannot pull as {encoding}: X 'w' holds 1e+300 (element " in str(
                info.value
            )
            assert "(element 1048581)" in str(info.value)
        with pytest.raises(ValueError, match="travels native"):
            c.pull("g", state=True, encoding="float16")  # refused before sending
        np.testing.assert_array_equal(c.pull("g")[0], x)  # the channel serves on
        assert _calls(server) - before == 1


def test_a_gradient_beyond_the_encoding_met_mid_frame_steps_nothing(
    server: ServerHandle,
) -> None:
    import asyncio

    from onnxps.client import AsyncClient, EncodingRangeError

    x = RNG.standard_normal(3 << 20).astype(np.float32)  # 6 blocks of encoding
    g = np.ones_like(x)
    g[(5 << 19) + 7] = 1e6  # float16 holds at most 65504: found in the 6th block
    opts: dict[str, Any] = {"data_channel": "on", "shared_memory": "off"}
    with Client(server.address, **opts) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        before = _calls(server)
        with pytest.raises(EncodingRangeError, match=r"\(element 2621447\)"):
            c.push("g", g, encoding="float16")

        async def pushed() -> None:
            async with AsyncClient(server.address, **opts) as ps:
                with pytest.raises(EncodingRangeError, match="element 2621447"):
                    await ps.push("g", g, encoding="float16")

        asyncio.run(pushed())
        _until(lambda: _open(server) == 0)  # both channels closed, both calls ended
        assert c.describe_group("g").update_count == 0
        np.testing.assert_array_equal(c.pull("g", encoding="native")[0], x)
        assert c.push("g", g, encoding="bfloat16") == 1  # bfloat16 holds it
        assert _calls(server) - before == 2  # the pull and the last push


def test_a_truncated_encoded_frame_is_refused(server: ServerHandle) -> None:
    x = np.zeros(1 << 18, np.float32)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
    sock, cid = _raw_channel(server)
    req = _push_request(cid, 1, x)
    req.gradients[0].encoding = pb.ENCODING_BFLOAT16
    with grpc.insecure_channel(server.address) as ch:
        push = multicallable(ch, "Push")
        # a native-sized frame for an encoded header: refused by its size
        future = push.future(req, timeout=20)
        sock.sendall(_frame(1, b"", declared=x.nbytes))
        err = _grpc_error(future.result)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == (
            f"the data channel frame carries {x.nbytes} bytes; the gradients' "
            f"headers declare {x.size * 2}"
        )
        sock.close()
        sock, cid = _raw_channel(server)
        req = _push_request(cid, 1, x)
        req.gradients[0].encoding = pb.ENCODING_FLOAT16
        future = push.future(req, timeout=20)
        sock.sendall(_frame(1, b"\0" * 1000, declared=x.size * 2))
        sock.close()
        err = _grpc_error(future.result)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == (
            f"the data channel closed after 1000 of {x.size * 2} bytes of this "
            "call's frame: the gradients are incomplete"
        )
    with Client(server.address) as c:
        assert c.describe_group("g").update_count == 0
        np.testing.assert_array_equal(c.pull("g")[0], x)


def _raw_channel(
    handle: ServerHandle, token: str | None = None
) -> tuple[socket.socket, bytes]:
    """A channel opened by hand: hello over gRPC, connect, present the ticket."""
    with grpc.insecure_channel(handle.address) as ch:
        md = [("authorization", f"Bearer {token}")] if token else None
        hello = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(), timeout=10, metadata=md
        )
    sock = socket.create_connection(("127.0.0.1", hello.port), timeout=10)
    sock.sendall(b"ONNXPSD1" + hello.ticket)
    assert sock.recv(1) == b"\x00"
    channel_id = b""
    while len(channel_id) < 16:
        channel_id += sock.recv(16 - len(channel_id))
    return sock, channel_id


def _refusal(handle: ServerHandle, preamble: bytes) -> str:
    assert handle.data_port is not None
    with socket.create_connection(("127.0.0.1", handle.data_port), timeout=10) as s:
        s.sendall(preamble)
        assert s.recv(1) == b"\x01"
        (n,) = struct.unpack("<H", s.recv(2))
        return s.recv(n).decode()


def test_connections_without_a_good_ticket_are_refused(server: ServerHandle) -> None:
    assert _refusal(server, b"ONNXPSD1" + secrets.token_bytes(32)) == (
        "unknown, used or expired ticket: ask DataChannelHello again"
    )
    assert _refusal(server, b"GET / HTTP/1.1\r\n" + b"x" * 24) == (
        "not an onnxps data channel preamble (magic ONNXPSD1)"
    )
    with grpc.insecure_channel(server.address) as ch:
        hello = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(), timeout=10
        )
    assert hello.ticket_seconds == 10.0
    with socket.create_connection(("127.0.0.1", hello.port), timeout=10) as s:
        s.sendall(b"ONNXPSD1" + hello.ticket)
        assert s.recv(1) == b"\x00"
        assert _refusal(server, b"ONNXPSD1" + hello.ticket).startswith(
            "unknown, used or expired ticket"
        )  # single use


def _push_request(
    channel_id: bytes, transfer_id: int, x: np.ndarray, seq: int = 1
) -> pb.PushRequest:
    req = pb.PushRequest(group="g", client_id="raw", seq=seq)
    req.gradients.append(header_tensor(x))
    req.transfer.channel = channel_id
    req.transfer.transfer_id = transfer_id
    return req


def _frame(transfer_id: int, data: bytes, declared: int | None = None) -> bytes:
    size = len(data) if declared is None else declared
    return struct.pack("<QQ", transfer_id, size) + data


def _grpc_error(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


def test_a_truncated_frame_is_refused_and_nothing_changes(server: ServerHandle) -> None:
    x = np.zeros(1 << 18, np.float32)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
    sock, cid = _raw_channel(server)
    with grpc.insecure_channel(server.address) as ch:
        push = multicallable(ch, "Push")
        future = push.future(_push_request(cid, 1, x), timeout=20)
        sock.sendall(_frame(1, np.ones(1000, np.float32).tobytes(), declared=x.nbytes))
        sock.close()  # the rest never comes
        err = _grpc_error(future.result)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the data channel closed after 4000 of" in (err.details() or "")
        # a frame of the wrong size, and a transfer id that is not new
        sock, cid = _raw_channel(server)
        future = push.future(_push_request(cid, 5, x), timeout=20)
        sock.sendall(_frame(5, b"", declared=x.nbytes - 4))
        err = _grpc_error(future.result)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == (
            f"the data channel frame carries {x.nbytes - 4} bytes; the gradients' "
            f"headers declare {x.nbytes}"
        )
        sock.close()
        sock, cid = _raw_channel(server)
        future = push.future(_push_request(cid, 3, x), timeout=20)
        sock.sendall(_frame(3, np.ones_like(x).tobytes()))
        assert future.result().update_count == 1
        err = _grpc_error(push, _push_request(cid, 3, x, seq=2), timeout=20)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "transfer 3 is not above this channel's last (3)" in (
            err.details() or ""
        )
        sock.close()
    with Client(server.address) as c:
        assert c.describe_group("g").update_count == 1
    _until(lambda: _open(server) == 0)


def test_a_call_that_never_sends_its_frame_ends_at_its_deadline(
    server: ServerHandle,
) -> None:
    x = np.zeros(1 << 18, np.float32)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
    sock, cid = _raw_channel(server)
    with grpc.insecure_channel(server.address) as ch:
        err = _grpc_error(
            multicallable(ch, "Push"), _push_request(cid, 1, x), timeout=1
        )
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _until(lambda: _open(server) == 0)  # closed by the server
    assert sock.recv(1) == b""
    sock.close()
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        assert c.push("g", np.ones_like(x)) == 1


def test_a_channel_serves_only_its_token(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-a write *\ntok-b write *\ntok-admin admin *\n")
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            data_port=0,
            tokens_file=str(tokens),
        )
    )
    x = np.zeros(1 << 18, np.float32)
    with Client(handle.address, token="tok-admin") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
    sock, cid = _raw_channel(handle, token="tok-a")
    with grpc.insecure_channel(handle.address) as ch:
        err = _grpc_error(
            multicallable(ch, "Push"),
            _push_request(cid, 1, x),
            timeout=10,
            metadata=[("authorization", "Bearer tok-b")],
        )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not open on the server" in (err.details() or "")
    sock.close()
    with Client(
        handle.address, token="tok-a", data_channel="on", shared_memory="off"
    ) as c:
        assert c.push("g", np.ones_like(x)) == 1
        assert _calls(handle) == 1


def test_a_client_killed_mid_frame_leaves_the_server_serving(
    server: ServerHandle, tmp_path: Path
) -> None:
    x = np.zeros(4 << 20, np.float32)  # 16 MiB
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
    script = textwrap.dedent(
        f"""
        import os, signal, socket, struct, grpc, numpy as np
        from onnxps.client._settings import multicallable
        from onnxps.wire.codec import header_tensor
        from onnxps.v1 import parameter_server_pb2 as pb
        ch = grpc.insecure_channel({server.address!r})
        hello = multicallable(ch, "DataChannelHello")(pb.DataChannelHelloRequest())
        s = socket.create_connection(("127.0.0.1", hello.port))
        s.sendall(b"ONNXPSD1" + hello.ticket)
        assert s.recv(1) == b"\\x00"
        cid = s.recv(16)
        x = np.ones({x.size}, np.float32)
        req = pb.PushRequest(group="g", client_id="k", seq=1)
        req.gradients.append(header_tensor(x))
        req.transfer.channel = cid
        req.transfer.transfer_id = 1
        f = multicallable(ch, "Push").future(req, timeout=60)
        s.sendall(struct.pack("<QQ", 1, x.nbytes) + x.tobytes()[: x.nbytes // 2])
        print("half", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "half\n"
    _until(lambda: _open(server) == 0)
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        assert c.describe_group("g").update_count == 0
        assert c.push("g", np.ones_like(x)) == 1


def test_idle_channels_of_a_closed_client_are_closed(server: ServerHandle) -> None:
    x = np.zeros(1 << 18, np.float32)
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        c.push("g", np.ones_like(x))
        assert _open(server) == 1
    _until(lambda: _open(server) == 0, seconds=5)


def test_data_port_is_checked_with_the_rest_of_the_config() -> None:
    from onnxps.server.interceptors.security import ConfigError

    with pytest.raises(
        ConfigError, match="data_port must be auto, off or a port 1..65535"
    ):
        ServerConfig(data_port=70000)
    with pytest.raises(ConfigError, match="on a unix: address use shared memory"):
        ServerConfig(address="unix:/tmp/x.sock", data_port=0)


def test_the_push_falls_back_to_grpc_when_the_server_forgot_the_channel(
    server: ServerHandle,
) -> None:
    """A server restarted (or one that closed the channel) answers
    DATA_CHANNEL_UNKNOWN: the push is resent over gRPC with its seq, once."""
    x = np.zeros(1 << 18, np.float32)
    with Client(server.address, data_channel="on", shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
        assert c.push("g", np.ones_like(x)) == 1
        assert server.data_channels is not None
        server.data_channels._close_idle(10)  # the server forgets it
        assert c.push("g", np.ones_like(x)) == 2
        assert c.push("g", np.ones_like(x)) == 3  # a new channel
        assert c.describe_group("g").update_count == 3


def test_a_duplicate_on_the_channel_is_answered_without_a_step(
    server: ServerHandle,
) -> None:
    x = np.zeros(1 << 18, np.float32)
    with Client(server.address) as c:
        c.create_group("g", Adam(), learning_rate=0.01, tensors={"w": x})
    sock, cid = _raw_channel(server)
    with grpc.insecure_channel(server.address) as ch:
        push = multicallable(ch, "Push")
        for tid in (1, 2):  # the same (client_id, seq) twice
            future = push.future(_push_request(cid, tid, x, seq=7), timeout=20)
            sock.sendall(_frame(tid, np.ones_like(x).tobytes()))
            reply = future.result()
            assert (reply.update_count, reply.duplicate) == (1, tid == 2)
    sock.close()
    with Client(server.address) as c:
        assert c.describe_group("g").update_count == 1


# -- TLS -------------------------------------------------------------------------------
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_a_tls_server_serves_tls_channels(
    servers: Callable[..., ServerHandle], tmp_path: Path, mutual: bool
) -> None:
    from _pki import _cert, _key, _pem, _pem_key

    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _cert("onnxps test CA", ca_key, "onnxps test CA", ca_key, ca=True)
    server_cert = _cert("localhost", server_key, "onnxps test CA", ca_key, server=True)
    client_cert = _cert("worker-1", client_key, "onnxps test CA", ca_key)
    (tmp_path / "ca.pem").write_bytes(_pem(ca))
    (tmp_path / "server.pem").write_bytes(_pem(server_cert))
    (tmp_path / "server.key").write_bytes(_pem_key(server_key))
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            data_port=0,
            tls_cert=str(tmp_path / "server.pem"),
            tls_key=str(tmp_path / "server.key"),
            tls_client_ca=str(tmp_path / "ca.pem") if mutual else None,
        )
    )
    creds: dict[str, Any] = {"root_certificates": _pem(ca), "shared_memory": "off"}
    if mutual:
        creds.update(
            private_key=_pem_key(client_key), certificate_chain=_pem(client_cert)
        )
    x = RNG.standard_normal(1 << 18).astype(np.float32)
    g = RNG.standard_normal(1 << 18).astype(np.float32)
    with (
        Client(handle.address, data_channel="on", **creds) as dc,
        Client(handle.address, data_channel="off", **creds) as ref,
    ):
        dc.create_group("dc", Adam(), learning_rate=0.01, tensors={"w": x})
        ref.create_group("ref", Adam(), learning_rate=0.01, tensors={"w": x})
        _same(
            dc.push("dc", g, return_values=True),
            ref.push("ref", g, return_values=True),
        )
        _same(dc.pull("dc", state=True), ref.pull("ref", state=True))
        assert _calls(handle) == 2
    # a plaintext preamble gets no channel: the TLS handshake fails, closed
    assert handle.data_port is not None
    with socket.create_connection(("127.0.0.1", handle.data_port), 10) as s:
        s.sendall(b"ONNXPSD1" + secrets.token_bytes(32))
        try:
            answer = s.recv(1)
        except ConnectionResetError:
            answer = b""
        assert answer in (b"", b"\x15")  # closed, or a TLS alert record


def test_a_cluster_client_uses_each_shards_data_channel(
    servers: Callable[..., ServerHandle],
) -> None:
    handles = [
        servers(
            ServerConfig(
                address="127.0.0.1:0", durability="none", shard=f"{i}/2", data_port=0
            )
        )
        for i in range(2)
    ]
    addresses = [h.address for h in handles]
    x0 = [RNG.standard_normal(s).astype(np.float32) for s in [(700, 800), (33,)]]
    grads = [[RNG.standard_normal(x.shape).astype(np.float32) for x in x0]]
    grads.append([g * 2 for g in grads[0]])
    with (
        # shared memory off: on one host it would go first, for each shard
        Client(
            addresses, split_bytes=1 << 20, data_channel="on", shared_memory="off"
        ) as dc,
        Client(addresses, split_bytes=1 << 20, data_channel="off") as ref,
    ):
        for c, name in ((dc, "dc"), (ref, "ref")):
            c.create_group(
                name, Adam(), learning_rate=0.01,
                tensors=[(f"x{i}", x) for i, x in enumerate(x0)],
            )  # fmt: skip
        assert len(dc.describe_group("dc").parts) == 2
        assert dc.push("dc", *grads[0]) == ref.push("ref", *grads[0]) == 1
        _same(
            dc.push("dc", *grads[1], return_values=True),
            ref.push("ref", *grads[1], return_values=True),
        )
        enc: Encoding = "bfloat16"
        assert dc.push("dc", *grads[0], encoding=enc) == ref.push(
            "ref", *grads[0], encoding=enc
        )
        _same(dc.pull("dc"), ref.pull("ref"))
        _same(dc.pull("dc", state=True), ref.pull("ref", state=True))
    assert [_calls(h) for h in handles] == [5, 5]  # every part, both shards


def test_the_async_client_uses_the_channel_like_the_client(
    server: ServerHandle,
) -> None:
    import asyncio

    from onnxps.client import AsyncClient

    x0 = [RNG.standard_normal(s).astype(np.float32) for s in [(400, 700), (5,)]]
    grads = [[RNG.standard_normal(x.shape).astype(np.float32) for x in x0]]
    grads.append([g * 3 for g in grads[0]])

    async def run() -> list[list[np.ndarray]]:
        opts: dict[str, Any] = {"data_channel": "on", "shared_memory": "off"}
        async with AsyncClient(server.address, **opts) as ps:
            await ps.create_group(
                "async", Adam(), learning_rate=0.01,
                tensors=[(f"x{i}", x) for i, x in enumerate(x0)],
            )  # fmt: skip
            assert await ps.push("async", *grads[0]) == 1
            got = [await ps.push("async", *grads[1], return_values=True)]
            assert await ps.push("async", *grads[0], encoding="float16") == 3
            got.append(await ps.pull("async", state=True))
            # a cancelled pull closes its channel; the next call opens another
            task = asyncio.ensure_future(ps.pull("async", min_version=99))
            deadline = time.monotonic() + 30
            while server.store.waiting_calls == 0:  # the pull waits at the server
                assert time.monotonic() < deadline, "the pull never reached the server"
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            got.append(await ps.pull("async"))
            return got

    got = asyncio.run(run())
    with Client(server.address, data_channel="off", shared_memory="off") as ref:
        ref.create_group(
            "sync", Adam(), learning_rate=0.01,
            tensors=[(f"x{i}", x) for i, x in enumerate(x0)],
        )  # fmt: skip
        ref.push("sync", *grads[0])
        _same(got[0], ref.push("sync", *grads[1], return_values=True))
        ref.push("sync", *grads[0], encoding="float16")
        _same(got[1], ref.pull("sync", state=True))
        _same(got[2], ref.pull("sync"))
    assert _calls(server) == 5  # the cancelled pull did not finish
    _until(lambda: _open(server) == 0)


@pytest.mark.parametrize("encoding", ["native", "bfloat16"])
def test_a_wrong_out_is_the_error_the_grpc_path_gives(
    server: ServerHandle, encoding: Encoding
) -> None:
    x = np.ones(1 << 19, np.float32)
    wrong = {
        # as many bytes (native) or elements (encoded) as X: the frame fits it
        "native": np.empty(1 << 18, np.float64),
        "bfloat16": np.empty(1 << 19, np.float64),
    }[encoding]
    said = []
    for mode in ("on", "off"):
        with Client(server.address, data_channel=mode, shared_memory="off") as c:
            c.create_group(mode, Adam(), learning_rate=0.1, tensors={"w": x})
            with pytest.raises(ValueError) as info:
                c.pull(mode, encoding=encoding, out=[wrong])
            said.append(str(info.value))
            right = np.empty_like(x)
            assert c.pull(mode, encoding=encoding, out=[right])[0] is right
            np.testing.assert_array_equal(right, x)
    assert (
        said[0]
        == said[1]
        == (
            f"out[0] must be a float32 array of shape (524288,), got {wrong.dtype} "
            f"{wrong.shape}"
        )
    )


def test_an_encoded_pull_of_a_group_replaced_since_is_still_exact(
    server: ServerHandle,
) -> None:
    # The client widens an encoded X as it lands, into one buffer of the group's
    # dtype as it last saw it; here the group was replaced by another client in
    # the meantime (float64, other shapes, the same element count).
    first = [RNG.standard_normal(s).astype(np.float32) for s in [(512, 1024), (8,)]]
    then = [RNG.standard_normal(s).astype(np.float64) for s in [(8,), (1024, 512)]]
    with (
        Client(server.address, data_channel="on", shared_memory="off") as dc,
        Client(server.address, data_channel="off", shared_memory="off") as other,
    ):
        other.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"a": first[0], "b": first[1]}
        )
        got = dc.pull("g", encoding="bfloat16")
        _same(got, [_rounded(a, "bfloat16") for a in first])
        other.delete_group("g")
        other.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"c": then[0], "d": then[1]}
        )
        before = _calls(server)
        got = dc.pull("g", encoding="bfloat16")
        assert _calls(server) - before == 1
        _same(got, other.pull("g", encoding="bfloat16"))
        assert [(a.dtype, a.shape) for a in got] == [
            (np.dtype(np.float64), (8,)), (np.dtype(np.float64), (1024, 512)),
        ]  # fmt: skip
        _same(dc.pull("g", encoding="float16"), other.pull("g", encoding="float16"))
