"""Call channels and data channels under clients that misbehave, on a real server
process (threads, descriptors and memory read from /proc): a closed call channel
ends its calls, and a large frame Pull holds what the in-flight budget counts."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import start_server, stop
from onnxps.client import Adam, Client
from onnxps.client._errors import DeadlineExceededError, ResourceExhaustedError
from onnxps.client._settings import multicallable
from onnxps.server._frames import CALL_MAGIC, read_reply, write_call
from onnxps.v1 import parameter_server_pb2 as pb

MIB = 1 << 20
READER = (("authorization", "Bearer reader-token"),)


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _call_channel(
    address: str, metadata: tuple[tuple[str, str], ...] = ()
) -> socket.socket:
    with grpc.insecure_channel(address) as ch:
        hello = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(), metadata=metadata, timeout=10
        )
    sock = socket.create_connection(("127.0.0.1", hello.port), timeout=10)
    sock.sendall(CALL_MAGIC + hello.ticket)
    answer = sock.recv(1 + 16)
    assert answer[:1] == b"\x00", answer
    return sock


def _until(check: object, seconds: float) -> bool:
    """Poll ``check()`` until it is true or ``seconds`` pass (its last answer)."""
    deadline = time.monotonic() + seconds
    while True:
        if check():  # type: ignore[operator]
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("reader-token read *\nadmin-token admin *\n")
    return path


@pytest.fixture
def reader_server(tmp_path: Path, tokens: Path) -> Iterator[tuple[int, str]]:
    proc, address = start_server(
        tmp_path / "server.log",
        "--data-port",
        "0",
        "--tokens-file",
        str(tokens),
        "--max-waiting-calls",
        "4",
    )
    try:
        yield proc.pid, address
    finally:
        stop(proc)


def _waits_refused(address: str) -> bool:
    """Another tenant's pull(min_version) is refused for want of a waiting slot."""
    with Client(address, token="admin-token", data_channel="off") as c:
        try:
            c.pull("g", min_version=1 << 62, timeout=0.5)
        except ResourceExhaustedError:
            return True
        except DeadlineExceededError:
            return False
    raise AssertionError("a pull for T=2^62 answered")


def test_closing_a_call_channel_ends_its_waiting_calls(
    reader_server: tuple[int, str],
) -> None:
    """Pulls waiting for a version on call channels whose client closed them: the
    waits end, their threads and descriptors go, and another tenant may wait
    again (before: all held until the version came, for ever)."""
    pid, address = reader_server
    with Client(address, token="admin-token", data_channel="off") as admin:
        admin.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(8, np.float32)}
        )
    assert not _waits_refused(address)  # and the gRPC worker threads are warm
    threads0, fds0 = _status(pid, "Threads"), _fds(pid)
    waiting = [_call_channel(address, READER) for _ in range(4)]
    request = pb.PullRequest(group="g", min_version=1 << 62).SerializeToString()
    for sock in waiting:
        write_call(sock, 2, 0.0, request)  # no deadline
    assert _until(lambda: _waits_refused(address), 10)
    threads1, fds1 = _status(pid, "Threads"), _fds(pid)
    for sock in waiting:
        sock.close()
    ended = _until(lambda: not _waits_refused(address), 10)
    threads2, fds2 = _status(pid, "Threads"), _fds(pid)
    figures = f"threads {threads0} {threads1} {threads2}, fds {fds0} {fds1} {fds2}"
    assert threads1 >= threads0 + 4, figures
    assert ended, f"the 4 waits still hold their slots: {figures}"
    assert _until(lambda: _status(pid, "Threads") <= threads0, 10), figures
    assert _until(lambda: _fds(pid) <= fds0, 10), figures


def test_a_waiting_frame_call_ends_when_its_deadline_passes_as_before(
    reader_server: tuple[int, str],
) -> None:
    """The channel stays open and a deadline still ends the wait with its status."""
    _, address = reader_server
    with Client(address, token="admin-token", data_channel="off") as admin:
        admin.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(8, np.float32)}
        )
    with _call_channel(address, READER) as sock:
        request = pb.PullRequest(group="g", min_version=5).SerializeToString()
        write_call(sock, 2, 0.5, request)
        code, _, details, _ = read_reply(sock)
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED, details
        write_call(sock, 2, 5.0, pb.PullRequest(group="g").SerializeToString())
        code, body, _, _ = read_reply(sock)
        assert code is grpc.StatusCode.OK
        assert pb.PullResponse.FromString(body).update_count == 0


def test_a_large_frame_pull_holds_what_the_budget_counts(tmp_path: Path) -> None:
    """A 64 MiB Pull on a call channel whose client reads its reply late: the
    server holds one copy of the tensor while the reply waits (before: the reply
    framed three times over, 192 MiB), and the in-flight budget counts it until
    it has left (before: released before the send, so a second pull was let in)."""
    n = 64 * MIB // 4
    proc, address = start_server(
        tmp_path / "server.log",
        "--data-port",
        "0",
        "--max-inflight-bytes",
        str(100 * MIB),
    )
    try:
        x = np.arange(n, dtype=np.float32)
        with Client(address, timeout=120, data_channel="off", shared_memory="off") as c:
            c.create_group("big", Adam(), learning_rate=0.1, tensors={"w": x})
            c.pull("big")  # the gRPC path's buffers once, for the baseline
            sock = _call_channel(address)
            with sock:
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # HWM = RSS
                before = _status(proc.pid, "VmRSS")
                request = pb.PullRequest(group="big").SerializeToString()
                write_call(sock, 2, 0.0, request)
                time.sleep(2)  # the reply is made and waits for its reader
                grown = (_status(proc.pid, "VmHWM") - before) / 1024
                with pytest.raises(ResourceExhaustedError, match="in-flight bytes"):
                    c.pull("big", timeout=10)
                code, body, details, _ = read_reply(sock)
            assert code is grpc.StatusCode.OK, details
            reply = pb.PullResponse.FromString(body)
            got = np.frombuffer(reply.tensors[0].raw_data, np.float32)
            np.testing.assert_array_equal(got, x)
            assert c.pull("big")[0].shape == (n,)  # the reply sent: its bytes freed
        # one copy of X (64 MiB) and the serving's small change
        assert grown < 64 * 1.25, f"the server grew {grown:.0f} MiB over the pull"
    finally:
        stop(proc)
