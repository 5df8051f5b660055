"""Calls whose client stalls cannot stop a server started with default flags.

Issue 27, items 5-9, each an attack run against a real ``onnxps serve`` process on
127.0.0.1: gRPC streams that send a header and then nothing, data-channel pushes
whose frame never comes (no deadline), connections that drip their handshake a
byte at a time, 1,100 channels left open by a client, and data-channel calls made
without a deadline. Each time the health check and an honest push are served,
the stalled calls end with a precise status, and what they held is released.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _procs import clean_env, start_server, stop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.client import Adagrad, Client
from onnxps.client._settings import multicallable
from onnxps.server.app import ServerConfig, thread_limits
from onnxps.server.interceptors.security import ConfigError
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import header_tensor

TOKENS = {"admin": "tok-admin", "write": "tok-write", "read": "tok-read"}
STALLED = 72  # more than the 64 streams the defaults admit
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def _serve(tmp_path: Path, *args: str) -> tuple[Any, str]:
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} {role} *\n" for role, t in TOKENS.items()))
    return start_server(
        tmp_path / "server.log", "--tokens-file", str(tokens), *args, env=clean_env()
    )


def _md(role: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[role]}"),)


def _until(probe: Callable[[], bool], seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not probe():
        assert time.monotonic() < end, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def _code(f: Any) -> grpc.StatusCode | None:
    """A finished call's status code (None while it runs)."""
    if not f.done():
        return None
    exc = f.exception()
    return grpc.StatusCode.OK if exc is None else exc.code()


def _served(address: str, group: str) -> None:
    """The health check and an admin's push are answered (15 s each)."""
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=15
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with Client(address, token=TOKENS["admin"], timeout=15, shared_memory="off") as c:
        t = c.describe_group(group).update_count
        assert c.push(group, np.ones((8, 4), np.float32)) == t + 1


def _create(address: str, shape: tuple[int, ...] = (8, 4)) -> None:
    with Client(address, token=TOKENS["admin"], timeout=30) as c:
        w = np.zeros(shape, np.float32)
        c.create_group("g", Adagrad(), learning_rate=0.5, tensors={"w": w})


def _stalled(first: Any | None, release: threading.Event) -> Iterator[Any]:
    """A request stream that sends ``first`` (if any) and then nothing."""
    if first is not None:
        yield first
    release.wait(120)


def _push_header() -> pb.PushStreamRequest:
    header = pb.PushRequest(group="g", client_id="stall", seq=1)
    header.gradients.append(header_tensor(np.zeros((8, 4), np.float32)))
    return pb.PushStreamRequest(header=header)


def _pull_rows_header() -> pb.PullRowsRequest:
    header = pb.PullRowsHeader(group="g")
    header.tensors.add(name="w", indices=header_tensor(np.zeros(2, np.int64)))
    return pb.PullRowsRequest(header=header)


STREAMS = {
    # (role of the token, how a stalled call is opened)
    "PushStream": ("write", _push_header),
    "PullRows": ("read", _pull_rows_header),
}


def _open_stalled(
    channels: list[grpc.Channel], kind: str, n: int, release: threading.Event
) -> list[Any]:
    role, first = STREAMS[kind]
    calls: list[Any] = []
    for i in range(n):
        stub = pb_grpc.ParameterServerServiceStub(channels[i % len(channels)])
        gen = _stalled(first(), release)
        if kind == "PushStream":
            calls.append(stub.PushStream.future(gen, metadata=_md(role)))
        else:  # a stream-stream call is its own future
            calls.append(stub.PullRows(gen, metadata=_md(role)))
    return calls


def test_the_defaults_keep_threads_for_short_calls() -> None:
    """Item 5: streams (data-channel calls too) and waiting calls hold at most
    96 of the default 128 threads; settings that would take them all are refused."""
    config = ServerConfig()
    assert (config.threads, config.stall_seconds) == (128, 30.0)
    assert thread_limits(config) == (64, 32)
    assert thread_limits(ServerConfig(threads=8)) == (4, 2)
    with pytest.raises(ConfigError) as info:
        thread_limits(ServerConfig(threads=64, max_concurrent_streams=64))
    assert str(info.value) == (
        "max_concurrent_streams (64) + max_waiting_calls (16) must be below "
        "--threads (64), so that streams and waiting calls leave threads for short "
        "calls and health checks"
    )
    with pytest.raises(ConfigError, match="stall_seconds must be a finite number"):
        ServerConfig(stall_seconds=0)


@pytest.mark.parametrize("kind", list(STREAMS))
def test_stalled_streams_leave_the_defaults_serving(tmp_path: Path, kind: str) -> None:
    """Item 5: 72 streams that send a header and then nothing (no deadline): 64
    are admitted, the others refused at once, and health and pushes are served."""
    proc, address = _serve(tmp_path)  # default flags
    release = threading.Event()
    channels = [grpc.insecure_channel(address) for _ in range(8)]
    try:
        _create(address)
        calls = _open_stalled(channels, kind, STALLED, release)

        def refused() -> int:
            return sum(_code(f) == EXHAUSTED for f in calls)

        _until(lambda: refused() == STALLED - 64, 30, "the streams over 64 refused")
        assert sum(_code(f) is None for f in calls) == 64  # held, not refused
        refusal = next(f for f in calls if _code(f) == EXHAUSTED).exception()
        assert refusal.details() == (
            "the server is at its limit of 64 concurrent streams; retry later"
        )
        _served(address, "g")
        assert sum(_code(f) is None for f in calls) == 64
    finally:
        release.set()
        for ch in channels:
            ch.close()
        stop(proc)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*STREAMS, "silent"])
def test_a_stream_that_stops_sending_ends(tmp_path: Path, kind: str) -> None:
    """Item 5: a stream that stops sending ends after --stall-seconds with
    DEADLINE_EXCEEDED, deadline or not, and its slot is free again."""
    proc, address = _serve(tmp_path, "--stall-seconds", "1")
    release = threading.Event()
    channels = [grpc.insecure_channel(address) for _ in range(8)]
    try:
        _create(address)
        if kind == "silent":  # not even a header
            stubs = [pb_grpc.ParameterServerServiceStub(ch) for ch in channels]
            calls = [
                stubs[i % 8].PushStream.future(
                    _stalled(None, release), metadata=_md("write")
                )
                for i in range(64)
            ]
            method = "PushStream"
        else:
            calls = _open_stalled(channels, kind, 64, release)
            method = kind
        _until(lambda: all(_code(f) is not None for f in calls), 30, "stalls ended")
        assert {_code(f) for f in calls} == {DEADLINE}
        assert {f.exception().details() for f in calls} == {  # type: ignore[union-attr]
            f"the {method} stream sent nothing for 1 s (--stall-seconds): the "
            "server ended it"
        }
        _served(address, "g")
        with Client(
            address, token=TOKENS["admin"], timeout=10, transport="stream"
        ) as c:
            assert c.push("g", np.ones((8, 4), np.float32)) == 2  # a stream again
    finally:
        release.set()
        for ch in channels:
            ch.close()
        stop(proc)


# -- the data channel --------------------------------------------------------------
def _raw_channel(
    address: str | grpc.Channel, role: str = "write", rcvbuf: int | None = None
) -> tuple[socket.socket, bytes]:
    """A channel opened by hand: hello over gRPC, connect, present the ticket."""
    with (
        grpc.insecure_channel(address)
        if isinstance(address, str)
        else contextlib.nullcontext(address)
    ) as ch:
        hello = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(), timeout=10, metadata=_md(role)
        )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting: the window the server sees
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", hello.port))
    sock.sendall(b"ONNXPSD1" + hello.ticket)
    assert _recv(sock, 1) == b"\x00"
    return sock, _recv(sock, 16)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        assert part, f"closed after {len(buf)} of {n} bytes"
        buf += part
    return buf


def _channel_push(
    cid: bytes, x: np.ndarray, seq: int, return_values: bool = False
) -> pb.PushRequest:
    req = pb.PushRequest(
        group="g", client_id="raw", seq=seq, return_values=return_values
    )
    req.gradients.append(header_tensor(x))
    req.transfer.channel = cid
    req.transfer.transfer_id = 1
    return req


def test_stalled_data_channel_pushes_leave_the_defaults_serving(
    tmp_path: Path,
) -> None:
    """Item 6: 72 data-channel pushes with no deadline whose frame never comes
    count as streams: 64 held, the others refused, health and pushes served."""
    proc, address = _serve(tmp_path, "--data-port", "0")  # default flags
    channels = [grpc.insecure_channel(address) for _ in range(8)]
    socks = []
    try:
        _create(address)
        x = np.zeros((8, 4), np.float32)
        calls = []
        for i in range(STALLED):
            sock, cid = _raw_channel(address)
            socks.append(sock)
            push = multicallable(channels[i % 8], "Push")
            calls.append(
                push.future(_channel_push(cid, x, i + 1), metadata=_md("write"))
            )

        def refused() -> int:
            return sum(_code(f) == EXHAUSTED for f in calls)

        _until(lambda: refused() == STALLED - 64, 30, "the pushes over 64 refused")
        assert sum(_code(f) is None for f in calls) == 64
        _served(address, "g")
        assert sum(_code(f) is None for f in calls) == 64
    finally:
        for s in socks:
            s.close()
        for ch in channels:
            ch.close()
        stop(proc)


def test_a_data_channel_frame_that_never_comes_ends_its_call(tmp_path: Path) -> None:
    """Item 6: with no deadline, a push whose frame stops (before its header, or
    mid-frame) ends after --stall-seconds with DEADLINE_EXCEEDED; its channel is
    closed, nothing is applied, and the channel serves honest pushes again."""
    proc, address = _serve(tmp_path, "--data-port", "0", "--stall-seconds", "1")
    socks = []
    try:
        _create(address, (1 << 16, 4))
        x = np.ones((1 << 16, 4), np.float32)  # 1 MiB
        with grpc.insecure_channel(address) as ch:
            push = multicallable(ch, "Push")
            calls = []
            for i in range(64):
                sock, cid = _raw_channel(address)
                socks.append(sock)
                calls.append(
                    push.future(_channel_push(cid, x, i + 1), metadata=_md("write"))
                )
                if i % 2:  # the header and 1,000 bytes, then nothing
                    sock.sendall(struct.pack("<QQ", 1, x.nbytes) + b"\0" * 1000)
            _until(lambda: all(_code(f) is not None for f in calls), 30, "ended")
        assert {_code(f) for f in calls} == {DEADLINE}
        details = [f.exception().details() for f in calls]
        assert set(details[0::2]) == {
            "the data channel carried no byte of this call's frame for 1 s (at its "
            "header; --stall-seconds): the call ended"
        }
        assert set(details[1::2]) == {
            "the data channel carried no byte of this call's frame for 1 s (at byte "
            f"1000 of {x.nbytes}; --stall-seconds): the call ended"
        }
        for s in socks:  # closed by the server
            s.settimeout(10)
            assert s.recv(1) == b""
        with Client(
            address,
            token=TOKENS["admin"],
            timeout=10,
            data_channel="on",
            shared_memory="off",
        ) as c:
            assert c.describe_group("g").update_count == 0  # nothing applied
            assert c.push("g", x) == 1
    finally:
        for s in socks:
            s.close()
        stop(proc)


def test_a_frame_that_comes_before_its_call_is_not_reaped(tmp_path: Path) -> None:
    """A client sends a push's frame as soon as it started the gRPC call naming
    the channel; under load the frame is there seconds before the call's handler
    runs. The reaper (a round a second) used to close such a channel as holding
    "bytes no call asked for", and the push failed FAILED_PRECONDITION
    (DATA_CHANNEL_UNKNOWN; the client then resent it over gRPC): seen under CI's
    load. Now such bytes wait for their call; bytes no call ever asks for close
    the channel after ``UNASKED_SECONDS`` (10 s)."""
    from onnxps.server.transports._datachannel import UNASKED_SECONDS

    proc, address = _serve(tmp_path, "--data-port", "0")
    socks = []
    try:
        _create(address)
        x = np.full((8, 4), 0.5, np.float32)
        sock, cid = _raw_channel(address)
        junk, _ = _raw_channel(address)
        socks += [sock, junk]
        sock.sendall(struct.pack("<QQ", 1, x.nbytes) + x.tobytes())  # the frame first
        junk.sendall(b"no call will ever ask for these")
        time.sleep(2.5)  # two rounds of the reaper at least
        with grpc.insecure_channel(address) as ch:
            reply = multicallable(ch, "Push")(
                _channel_push(cid, x, 1), timeout=10, metadata=_md("write")
            )
        assert reply.update_count == 1 and reply.applied
        junk.settimeout(UNASKED_SECONDS + 5)
        started = time.monotonic()
        assert junk.recv(1) == b""  # closed by the server, after its grace
        waited = time.monotonic() - started + 2.5
        assert UNASKED_SECONDS - 1 <= waited <= UNASKED_SECONDS + 5
    finally:
        for s in socks:
            s.close()
        stop(proc)


@pytest.mark.slow
def test_a_handshake_has_five_seconds_in_all(tmp_path: Path) -> None:
    """Item 7: 64 connections dripping a byte every 0.5 s (from two addresses: one
    holds at most 32 slots) hold every handshake slot only until their 5 s are
    up (the test_channel_hardening flood: or until a newer connection needs a
    slot after their first second); then an honest handshake gets through."""
    proc, address = _serve(tmp_path, "--data-port", "0")
    drips: list[socket.socket] = []
    try:
        _create(address)
        with grpc.insecure_channel(address) as ch:
            port = multicallable(ch, "DataChannelHello")(
                pb.DataChannelHelloRequest(), timeout=10, metadata=_md("write")
            ).port
        drips = [
            socket.create_connection(
                ("127.0.0.1", port),
                timeout=10,
                source_address=(f"127.0.0.{2 + i % 2}", 0),
            )
            for i in range(64)
        ]
        preamble = b"ONNXPSD1" + b"\x07" * 32
        for s in drips:
            s.sendall(preamble[:1])
        # the 65th is refused while they drip
        with socket.create_connection(("127.0.0.1", port), timeout=10) as honest:
            assert honest.recv(1) == b"\x01"
            (n,) = struct.unpack("<H", _recv(honest, 2))
            assert _recv(honest, n) == b"too many connections are shaking hands: retry"
        sent = dict.fromkeys(drips, 1)
        answers: dict[socket.socket, bytes] = {}
        for _ in range(len(preamble)):  # bounded: the whole preamble at most
            time.sleep(0.5)
            for s in drips:
                if s in answers:
                    continue
                s.setblocking(False)
                try:
                    answers[s] = s.recv(1000)  # the server's last word
                    continue
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
                s.sendall(preamble[sent[s] : sent[s] + 1])
                sent[s] += 1
            if len(answers) == len(drips):
                break
        assert len(answers) == 64  # every dripper was cut off by the server
        assert max(sent.values()) < len(preamble)  # before it sent its preamble
        why = b"no complete preamble within 5 s: a handshake has that long in all"
        assert set(answers.values()) == {b"\x01" + struct.pack("<H", len(why)) + why}
        with Client(
            address,
            token=TOKENS["admin"],
            timeout=10,
            data_channel="on",
            shared_memory="off",
        ) as c:
            assert c.push("g", np.ones((8, 4), np.float32)) == 1
    finally:
        for s in drips:
            s.close()
        stop(proc)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_1100_channels_left_open_are_reaped(tmp_path: Path) -> None:
    """Item 8: channels whose client went away are closed by the reaper, also when
    the server's descriptors pass 1,023 (select() cannot watch those)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft < want:  # the server inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    proc, address = _serve(tmp_path, "--data-port", "0")
    socks: list[socket.socket] = []
    try:
        _create(address)
        before = _fds(proc.pid)
        with grpc.insecure_channel(address) as ch:
            for _ in range(1100):
                socks.append(_raw_channel(ch)[0])
        # the server keeps 1,024 channels (the oldest idle ones beyond are closed)
        _until(lambda: _fds(proc.pid) >= before + 1000, 10, "1,024 channels open")
        for s in socks:
            s.close()
        _until(lambda: _fds(proc.pid) <= before + 8, 15, "the channels reaped")
        _served(address, "g")
    finally:
        for s in socks:
            s.close()
        stop(proc)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_data_channel_calls_without_a_deadline(tmp_path: Path) -> None:
    """Item 9: a Pull and a Push(return_values) on the data channel with no gRPC
    deadline (grpcurl's, and most languages' default) are answered."""
    proc, address = _serve(tmp_path, "--data-port", "0")
    try:
        _create(address)
        with grpc.insecure_channel(address) as ch:
            sock, cid = _raw_channel(address)
            req = pb.PullRequest(group="g")
            req.transfer.channel = cid
            req.transfer.transfer_id = 1
            reply = multicallable(ch, "Pull")(req, metadata=_md("write"))
            assert reply.tensors_on_channel and reply.update_count == 0
            assert _recv(sock, 16) == struct.pack("<QQ", 1, 8 * 4 * 4)
            assert _recv(sock, 8 * 4 * 4) == bytes(8 * 4 * 4)
            g = np.ones((8, 4), np.float32)
            push = _channel_push(cid, g, 1, return_values=True)
            push.transfer.transfer_id = 2
            future = multicallable(ch, "Push").future(push, metadata=_md("write"))
            sock.sendall(struct.pack("<QQ", 2, g.nbytes) + g.tobytes())
            reply = future.result(timeout=10)
            assert (reply.update_count, reply.applied) == (1, True)
            assert _recv(sock, 16) == struct.pack("<QQ", 2, g.nbytes)
            x = np.frombuffer(_recv(sock, g.nbytes), np.float32).reshape(8, 4)
            np.testing.assert_allclose(x, -0.5, rtol=1e-5)  # Adagrad's first: -R
            sock.close()
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_push_whose_values_cannot_be_sent_says_it_was_applied(
    tmp_path: Path,
) -> None:
    """Item 9: the one failure after a push is applied is the transport's; it says
    the push was applied (UNAVAILABLE), and the resend with the same seq is
    answered without a second step."""
    proc, address = _serve(tmp_path, "--data-port", "0", "--stall-seconds", "1")
    shape = (1 << 20, 8)  # X: 32 MiB, more than the sockets buffer
    try:
        _create(address, shape)
        g = np.ones(shape, np.float32)
        with grpc.insecure_channel(address) as ch:
            sock, cid = _raw_channel(address, rcvbuf=1 << 16)
            future = multicallable(ch, "Push").future(
                _channel_push(cid, g, 7, return_values=True), metadata=_md("write")
            )
            sock.sendall(struct.pack("<QQ", 1, g.nbytes) + g.tobytes())
            err = future.exception(timeout=30)  # X is never read
            assert isinstance(err, grpc.RpcError)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert (err.details() or "").startswith(
                "push seq 7 to group 'g' was applied (T=1) but its values could not "
                "be sent on the data channel (the client stopped reading"
            )
            sock.close()
        with Client(address, token=TOKENS["write"], timeout=10) as c:
            assert c.describe_group("g").update_count == 1
        with grpc.insecure_channel(address) as ch:
            resend = pb.PushRequest(group="g", client_id="raw", seq=7)
            resend.gradients.append(header_tensor(g))
            resend.gradients[0].raw_data = g.tobytes()
            reply = multicallable(ch, "Push")(resend, metadata=_md("write"), timeout=30)
            assert (reply.update_count, reply.duplicate) == (1, True)
    finally:
        stop(proc)


def test_at_the_stream_limit_a_channel_push_goes_over_grpc(tmp_path: Path) -> None:
    """A call on the data channel counts as a stream: when the stalled streams
    hold every slot, the client's channel push is refused with STREAM_LIMIT before
    anything is read, and the client sends it as a unary gRPC push instead."""
    proc, address = _serve(
        tmp_path, "--data-port", "0", "--max-concurrent-streams", "1"
    )
    release = threading.Event()
    big = np.zeros((1 << 16, 4), np.float32)  # 1 MiB
    try:
        _create(address)
        with Client(address, token=TOKENS["admin"], timeout=30) as c:
            c.create_group("big", Adagrad(), learning_rate=0.5, tensors={"w": big})
        with grpc.insecure_channel(address) as ch:
            held = _open_stalled([ch], "PushStream", 2, release)
            _until(lambda: any(_code(f) == EXHAUSTED for f in held), 30, "refused")
            with Client(
                address,
                token=TOKENS["write"],
                timeout=30,
                data_channel="on",
                shared_memory="off",
            ) as c:
                assert c.push("big", np.ones_like(big)) == 1
            assert sum(_code(f) is None for f in held) == 1  # still held
    finally:
        release.set()
        stop(proc)
