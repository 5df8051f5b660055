"""Push and Pull as frames on a call channel (``server.transports._frames``,
``client._frames``):
the same results as over gRPC, the same statuses for bad input, tokens checked on
every frame. The client side here is the frame functions over a raw socket."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np
import pytest
from google.rpc import status_pb2
from onnxps.client import Adam, Client
from onnxps.client._settings import multicallable
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.transports._frames import CALL_MAGIC, read_reply, write_call
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import EncodedMessage, tensor_to_array

N = 1000


@pytest.fixture
def server(servers: Callable[..., ServerHandle]) -> Iterator[ServerHandle]:
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", data_port=0)
    )
    yield handle


def _call_channel(
    handle: ServerHandle, metadata: tuple[tuple[str, str], ...] = ()
) -> socket.socket:
    with grpc.insecure_channel(handle.address) as ch:
        hello = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(), metadata=metadata, timeout=10
        )
    sock = socket.create_connection(("127.0.0.1", hello.port), timeout=10)
    sock.sendall(CALL_MAGIC + hello.ticket)
    answer = sock.recv(1 + 16)
    assert answer[:1] == b"\x00", answer
    return sock


def _push(
    sock: socket.socket, seq: int, g: np.ndarray, client_id: str = "f"
) -> pb.PushResponse:
    req = pb.PushRequest(group="g", client_id=client_id, seq=seq)
    write_call(sock, 1, 10.0, EncodedMessage(req, "gradients", [g]).SerializeToString())
    code, body, details, _ = read_reply(sock)
    assert code is grpc.StatusCode.OK, details
    return pb.PushResponse.FromString(body)


def test_frame_pushes_and_pulls_equal_the_grpc_path(server: ServerHandle) -> None:
    rng = np.random.default_rng(24)
    x0 = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(5)]
    with Client(server.address, data_channel="off") as c:
        c.create_group("g", Adam(), learning_rate=1e-2, tensors={"w": x0})
        c.create_group("h", Adam(), learning_rate=1e-2, tensors={"w": x0})
        for g in grads:
            c.push("h", g)
        want = c.pull("h")[0]
        sock = _call_channel(server)
        with sock:
            for i, g in enumerate(grads):
                got = _push(sock, i + 1, g)
                assert (got.update_count, got.applied) == (i + 1, True)
            again = _push(sock, 5, grads[-1])  # the same seq: not applied twice
            assert again.duplicate and again.update_count == 5
            write_call(sock, 2, 10.0, pb.PullRequest(group="g").SerializeToString())
            code, body, _, _ = read_reply(sock)
        assert code is grpc.StatusCode.OK
        pulled = pb.PullResponse.FromString(body)
        assert pulled.update_count == 5
        np.testing.assert_array_equal(tensor_to_array(pulled.tensors[0]), want)
        np.testing.assert_array_equal(c.pull("g")[0], want)


def test_a_bad_push_gets_the_grpc_status_and_changes_nothing(
    server: ServerHandle,
) -> None:
    with Client(server.address, data_channel="off") as c:
        c.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(N, np.float32)}
        )
        bad = pb.PushRequest(group="g", client_id="f", seq=1)
        raw = EncodedMessage(bad, "gradients", [np.zeros(N + 1, np.float32)])
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as over_grpc:
                multicallable(ch, "Push")(raw, timeout=10)
        with _call_channel(server) as sock:
            write_call(sock, 1, 10.0, raw.SerializeToString())
            code, _, details, trailing = read_reply(sock)
            assert code is over_grpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert details == over_grpc.value.details()
            rich = dict(trailing)["grpc-status-details-bin"]
            status = status_pb2.Status.FromString(rich)
            assert status.message == details and status.code == code.value[0]
            # nothing stepped: the next push is the first (and the channel still serves)
            assert _push(sock, 2, np.ones(N, np.float32)).update_count == 1


def test_a_call_channel_carries_its_hellos_token(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "reader-token read *\nworker-token write *\nadmin-token admin *\n"
    )
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            data_port=0,
            tokens_file=str(tokens),
        )
    )
    auth = (("authorization", "Bearer worker-token"),)
    with Client(handle.address, token="admin-token", data_channel="off") as c:
        c.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(N, np.float32)}
        )
    with _call_channel(handle, auth) as sock:
        assert _push(sock, 1, np.ones(N, np.float32)).applied
    with _call_channel(handle, (("authorization", "Bearer reader-token"),)) as sock:
        req = pb.PushRequest(group="g", client_id="r", seq=1)
        raw = EncodedMessage(req, "gradients", [np.ones(N, np.float32)])
        write_call(sock, 1, 10.0, raw.SerializeToString())
        code, _, details, _ = read_reply(sock)
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert details == "a read token may not call Push"


def test_a_refused_frame_is_answered_without_being_parsed(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    """As over gRPC, where a call refused from its metadata is never received: a
    read token's Push frame of bytes that are no PushRequest gets its refusal, not
    a parse error."""
    tokens = tmp_path / "tokens"
    tokens.write_text("reader-token read *\n")
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            data_port=0,
            tokens_file=str(tokens),
        )
    )
    reader = (("authorization", "Bearer reader-token"),)
    with _call_channel(handle, reader) as sock:
        for _ in range(2):  # the channel keeps the method's refusal
            write_call(sock, 1, 10.0, b"\xff\xff\xff not a message")
            code, _, details, _ = read_reply(sock)
            assert code is grpc.StatusCode.PERMISSION_DENIED
            assert details == "a read token may not call Push"


def test_the_client_with_frames_equals_grpc_and_falls_back(
    server: ServerHandle,
) -> None:
    """frames="on": pushes and pulls go as frames (the server counts no gRPC
    Push), bad input raises the gRPC path's error, and a call channel the server
    closes sends the next push over gRPC with nothing lost or doubled."""
    from onnxps.client import InvalidArgumentError

    rng = np.random.default_rng(25)
    x0 = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(6)]
    with Client(server.address, data_channel="off", frames="off") as plain:
        plain.create_group("a", Adam(), learning_rate=1e-2, tensors={"w": x0})
        plain.create_group("b", Adam(), learning_rate=1e-2, tensors={"w": x0})
        for g in grads:
            plain.push("a", g)
        want = plain.pull("a")[0]
        with pytest.raises(InvalidArgumentError) as over_grpc:
            plain.push("a", np.ones(N + 1, np.float32))
    assert server.data_channels is not None
    frames = server.data_channels.frame_calls
    with Client(server.address, data_channel="off", frames="on") as c:
        for i, g in enumerate(grads[:3]):
            assert c.push("b", g) == i + 1
        assert frames.calls == 3
        assert 0 in c._call_channels and not c._call_channels[0].closed
        with pytest.raises(InvalidArgumentError) as over_frames:
            c.push("b", np.ones(N + 1, np.float32))
        assert str(over_frames.value) == str(over_grpc.value)
        assert over_frames.value.reason == over_grpc.value.reason
        c._call_channels[0].sock.shutdown(socket.SHUT_RDWR)  # the socket breaks
        for i, g in enumerate(grads[3:]):
            assert c.push("b", g) == i + 4
        # the push after the break went over gRPC; the next two on a new channel
        assert frames.calls == 6
        np.testing.assert_array_equal(c.pull("b")[0], want)
        assert frames.calls == 7
        # a request over 1 MiB goes over gRPC
        c.create_group(
            "big",
            Adam(),
            learning_rate=0.1,
            tensors={"w": np.zeros(1 << 19, np.float32)},
        )
        assert c.push("big", np.ones(1 << 19, np.float32)) == 1
        assert frames.calls == 7


def test_frames_is_a_checked_client_option() -> None:
    from onnxps.client import AsyncClient

    said = "frames must be one of auto, on, off, got 'yes'"
    with pytest.raises(ValueError, match=said):
        Client("127.0.0.1:1", frames="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=said):
        AsyncClient("127.0.0.1:1", frames="yes")  # type: ignore[arg-type]


def test_the_async_client_sends_frames_too(server: ServerHandle) -> None:
    """AsyncClient(frames="on"): pushes and pulls as frames (the server counts
    them), the same T, X and errors as Client over gRPC; a broken channel sends
    the next push over gRPC, nothing lost or doubled."""
    import asyncio

    from onnxps.client import AsyncClient, InvalidArgumentError

    rng = np.random.default_rng(26)
    x0 = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(4)]
    with Client(server.address, data_channel="off", frames="off") as plain:
        plain.create_group("a", Adam(), learning_rate=1e-2, tensors={"w": x0})
        for g in grads:
            plain.push("a", g)
        want = plain.pull("a")[0]
        with pytest.raises(InvalidArgumentError) as over_grpc:
            plain.push("a", np.ones(N + 1, np.float32))
    assert server.data_channels is not None
    frames = server.data_channels.frame_calls

    async def run() -> None:
        async with AsyncClient(
            server.address, data_channel="off", frames="on", timeout=30
        ) as ac:
            await ac.create_group("b", Adam(), learning_rate=1e-2, tensors={"w": x0})
            assert [await ac.push("b", g) for g in grads[:3]] == [1, 2, 3]
            assert frames.calls == 3
            assert not ac._call_channels[0].closed
            with pytest.raises(InvalidArgumentError) as over_frames:
                await ac.push("b", np.ones(N + 1, np.float32))
            assert str(over_frames.value) == str(over_grpc.value)
            assert frames.calls == 4
            ac._call_channels[0].sock.shutdown(socket.SHUT_RDWR)  # it breaks
            assert await ac.push("b", grads[3]) == 4  # over gRPC
            assert frames.calls == 4
            got = await ac.pull("b")  # on a new channel
            assert frames.calls == 5
            np.testing.assert_array_equal(got[0], want)

    asyncio.run(run())


def test_call_channels_are_capped_and_a_stalled_frame_is_cut_off(
    servers: Callable[..., ServerHandle],
) -> None:
    from onnxps.server.transports._datachannel import MAX_CALL_CHANNELS

    handle = servers(
        ServerConfig(
            address="127.0.0.1:0", durability="none", data_port=0, stall_seconds=1.0
        )
    )
    open_ = [_call_channel(handle) for _ in range(MAX_CALL_CHANNELS)]
    with grpc.insecure_channel(handle.address) as ch:
        hello = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(), timeout=10
        )
    extra = socket.create_connection(("127.0.0.1", hello.port), timeout=10)
    extra.sendall(CALL_MAGIC + hello.ticket)
    refusal = extra.recv(200)
    assert refusal[:1] != b"\x00"
    assert f"{MAX_CALL_CHANNELS} call channels are open: use gRPC".encode() in refusal
    extra.close()
    too_big = open_[1]
    too_big.sendall(struct.pack("<I", 3 << 20))  # over MAX_FRAME: closed
    too_big.settimeout(10)
    assert too_big.recv(1) == b""
    stalled = open_[0]
    stalled.sendall(b"\x10")  # one byte of a frame's length, then nothing
    stalled.settimeout(10)
    t0 = time.monotonic()
    assert stalled.recv(1) == b""  # the server closed it
    assert 0.8 < time.monotonic() - t0 < 5
    for sock in open_:
        sock.close()


def test_busy_refused_and_draining_frames_go_over_grpc(
    servers: Callable[..., ServerHandle], server: ServerHandle
) -> None:
    """A busy call channel, a server without call channels, and a draining server's
    UNAVAILABLE: the call goes over gRPC (the frame count says which way)."""
    from onnxps.client import UnavailableError

    assert server.data_channels is not None
    frames = server.data_channels.frame_calls
    g = np.ones(N, np.float32)
    with Client(server.address, data_channel="off", frames="on") as c:
        c.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(N, np.float32)}
        )
        assert c.push("g", g) == 1 and frames.calls == 1
        ch = c._call_channels[0]
        with ch.lock:  # another thread's call holds it
            assert c.push("g", g) == 2
        assert frames.calls == 1
        assert c.push("g", g) == 3 and frames.calls == 2
        server.gate.close()  # draining: every new call is refused UNAVAILABLE
        with pytest.raises(UnavailableError, match="the server is shutting down"):
            c.push("g", g, timeout=3)
        # each of the client's resends tried a frame first, then gRPC's retries
        assert frames.calls >= 3
    bare = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", data_port="off")
    )
    with Client(bare.address, frames="on") as c:  # --data-port off: gRPC
        c.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(N, np.float32)}
        )
        assert c.push("g", g) == 1 and c.push("g", g) == 2
        assert c._call_channels == {}


def test_a_clusters_parts_go_as_frames_to_each_shard(
    servers: Callable[..., ServerHandle],
) -> None:
    shards = [
        servers(
            ServerConfig(
                address="127.0.0.1:0",
                durability="none",
                data_port=0,
                shard=f"{i}/2",
            )
        )
        for i in range(2)
    ]
    addresses = [h.address for h in shards]
    x0 = np.arange(2 * N, dtype=np.float32)
    g = np.ones(2 * N, np.float32)
    with Client(addresses, frames="on", split_bytes=N * 4) as c:
        c.create_group("split", Adam(), learning_rate=0.1, tensors={"w": x0})
        assert c.push("split", g) == 1
        pulled = c.pull("split")[0]
    with Client(addresses, split_bytes=N * 4, frames="off") as plain:
        plain.create_group("same", Adam(), learning_rate=0.1, tensors={"w": x0})
        plain.push("same", g)
        np.testing.assert_array_equal(pulled, plain.pull("same")[0])
    counts = [h.data_channels.frame_calls.calls for h in shards if h.data_channels]
    assert counts == [2, 2]  # each shard: its part of the push and of the pull


def test_with_no_flags_the_server_offers_a_data_port_and_small_calls_are_frames(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
) -> None:
    """``onnxps serve`` with no flags serves a data port on a free port (told to
    clients in the hello), and ``Client(address)`` sends its small pushes and
    pulls there as frames; ``--data-port off`` (or a unix: address) serves none,
    and its clients use gRPC."""
    import argparse

    from onnxps.server.cli import add_serve_arguments, config_from_args

    def parsed(*argv: str, **environ: str) -> ServerConfig:
        p = argparse.ArgumentParser()
        add_serve_arguments(p, environ)
        return config_from_args(p.parse_args(list(argv)))

    assert parsed().data_port == "auto" and parsed().data_port_number == 0
    assert parsed("--data-port", "off").data_port_number is None
    assert parsed("--data-port", "50053").data_port_number == 50053
    assert parsed(ONNXPS_DATA_PORT="off").data_port_number is None
    unix = f"unix:{tmp_path / 'ps.sock'}"
    assert parsed("--address", unix).data_port_number is None
    handle = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    assert handle.data_port is not None and handle.data_port > 0
    assert handle.data_channels is not None
    frames = handle.data_channels.frame_calls
    g = np.ones(N, np.float32)
    with Client(handle.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": 0 * g})
        assert c.push("g", g) == 1
        assert c.pull("g")[0].shape == (N,)
        assert frames.calls == 2
    off = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", data_port="off")
    )
    assert (off.data_port, off.data_channels) == (None, None)
    with Client(off.address) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": 0 * g})
        assert c.push("g", g) == 1 and c.push("g", g) == 2
        assert c._call_channels == {}
        # asked again after 10 s, then 20, 40, ... up to 10 minutes
        calls = c._transports.calls
        waits = []
        for _ in range(8):
            waits.append(calls._refused[0][1])
            calls._refused[0] = (0.0, waits[-1])  # its time has come
            assert c.push("g", g) > 2
        assert waits == [10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0, 600.0]


def test_large_frame_replies_read_in_place_equal_the_grpc_path(
    server: ServerHandle,
) -> None:
    """Replies over 64 KiB are read where they were received (``wire.replies``):
    a pull of several tensors and of X, V and H, a push returning X, a flat
    group of 200 tensors, a bfloat16 pull, each bit for bit what the gRPC path
    gives, each array writable and the client's own; the buffers are used again
    only once the arrays are dropped, and arrays still held never change."""
    rng = np.random.default_rng(41)
    shapes = {"w": (300, 200), "b": (20_000,), "c": (7, 3)}  # 240 + 80 KB
    x0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    flat0 = {f"t{i}": np.zeros(1000, np.float32) for i in range(200)}
    grads = [
        [rng.standard_normal(s).astype(np.float32) for s in shapes.values()]
        for _ in range(4)
    ]
    flat_g = [rng.standard_normal(1000).astype(np.float32) for _ in range(200)]
    results: dict[str, list[Any]] = {}
    assert server.data_channels is not None
    frames = server.data_channels.frame_calls
    for way in ("grpc", "frames"):
        framed: Literal["on", "off"] = "on" if way == "frames" else "off"
        with Client(
            server.address, data_channel="off", shared_memory="off", frames=framed
        ) as c:
            c.create_group(f"m-{way}", Adam(), learning_rate=1e-2, tensors=x0)
            c.create_group(f"f-{way}", Adam(), learning_rate=1e-2, tensors=flat0)
            before = frames.calls
            got: list[Any] = []
            for g in grads[:3]:
                c.push(f"m-{way}", *g)
            got.append(
                c.push_detailed(f"m-{way}", *grads[3], return_values=True).values
            )
            got.append(c.pull(f"m-{way}"))
            got.append(c.pull(f"m-{way}", state=True))
            got.append(c.pull(f"m-{way}", encoding="bfloat16"))
            c.push(f"f-{way}", *flat_g)
            got.append(c.pull(f"f-{way}"))
            results[way] = got
            if way == "frames":
                assert frames.calls - before == 9  # every call went as a frame
                held = c.pull(f"m-{way}")
                snapshot = [a.copy() for a in held]
                for a in got[1] + got[2]:
                    assert a.flags.writeable and a.flags.aligned
                c.push(f"m-{way}", *grads[0])
                for _ in range(4):  # more replies than the channel keeps buffers
                    c.pull(f"m-{way}")
                for a, s in zip(held, snapshot, strict=True):
                    assert a.tobytes() == s.tobytes()  # never written under it
            else:
                assert frames.calls == before
    for want, have in zip(results["grpc"], results["frames"], strict=True):
        assert [a.shape for a in have] == [a.shape for a in want]
        for a, b in zip(have, want, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
