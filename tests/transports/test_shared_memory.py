"""The same-host transport: tensors through /dev/shm, gRPC for control only.

Real servers (in-process on 127.0.0.1 port 0, or processes for kill -9), real
segments. Segment names carry their creator's pid, so each test looks only at the
segments of the processes it started (other test runs may share /dev/shm).
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _procs import StartServer, clean_env
from onnxps.client import (
    Adam,
    AsyncClient,
    Client,
    RpcError,
    SharedMemoryError,
    Sync,
    UnauthenticatedError,
)
from onnxps.client._errors import translate
from onnxps.client.shm import Segment, hello_segment
from onnxps.server.app import (
    MIN_MESSAGE_BYTES,
    ServerConfig,
    ServerHandle,
)
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import header_tensor
from onnxps.wire.shm import MAGIC, SHM_DIR

pytestmark = pytest.mark.skipif(
    not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)"
)

Stub = pb_grpc.ParameterServerServiceStub
N = 1 << 20  # 4 MiB of float32: above every inline limit these tests set
RNG = np.random.default_rng(7)
W0 = RNG.standard_normal(N).astype(np.float32)
B0 = RNG.standard_normal(33).astype(np.float32)
G = [RNG.standard_normal(N).astype(np.float32) for _ in range(3)]
GB = [RNG.standard_normal(33).astype(np.float32) for _ in range(3)]


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"onnxps-{pid}-"))


def wait_until(predicate: object, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(predicate())  # type: ignore[operator]


@pytest.fixture
def small_messages(servers: Callable[..., ServerHandle]) -> Iterator[str]:
    """A server whose gRPC messages cannot carry a 4 MiB tensor: what passes went
    through shared memory."""
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            max_message_bytes=MIN_MESSAGE_BYTES,
        )
    )
    yield handle.address


def _create(c: Client, name: str, **kw: object) -> None:
    c.create_group(
        name,
        Adam(),
        learning_rate=0.01,
        tensors={"w": W0, "b": B0},
        **kw,  # type: ignore[arg-type]
    )


def test_pushes_and_pulls_through_shared_memory_equal_the_grpc_path(
    small_messages: str, server: ServerHandle
) -> None:
    with (
        Client(small_messages, shared_memory="on", timeout=30) as shm,
        Client(server.address, shared_memory="off", timeout=30) as wire,
    ):
        _create(shm, "shm")
        _create(wire, "wire")
        for g, gb in zip(G[:2], GB[:2], strict=True):
            assert shm.push("shm", g, gb) == wire.push("wire", g, gb)
        x_shm = shm.push("shm", G[2], GB[2], return_values=True)
        x_wire = wire.push("wire", G[2], GB[2], return_values=True)
        assert all(np.array_equal(a, b) for a, b in zip(x_shm, x_wire, strict=True))
        t_shm, s_shm = shm.pull_versioned("shm", state=True)
        t_wire, s_wire = wire.pull_versioned("wire", state=True)
        assert t_shm == t_wire == 3
        assert len(s_shm) == 6
        assert all(np.array_equal(a, b) for a, b in zip(s_shm, s_wire, strict=True))
        assert np.array_equal(shm.pull("shm")[0], s_wire[0])
        # results are the caller's own arrays, not views of a reused segment
        first = shm.pull("shm")[0]
        shm.push("shm", G[0], GB[0])
        assert np.array_equal(first, s_wire[0])
        # packed in the segment, copied out at once: each writable, apart
        w, b = shm.pull("shm")
        w[...] = 0
        assert np.array_equal(b, shm.pull("shm")[1]) and b.any()
        assert segments_of(os.getpid())  # kept for the next calls
    assert segments_of(os.getpid()) == []  # close() unlinked them


def test_the_bytes_path_could_not_have_carried_them(small_messages: str) -> None:
    with Client(small_messages, shared_memory="off", timeout=30) as wire:
        _create(wire, "g")
    with Client(small_messages, transport="unary", timeout=30) as unary:
        with pytest.raises(RpcError) as err:
            unary.push("g", G[0], GB[0])
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_async_client_uses_shared_memory_too(small_messages: str) -> None:
    import asyncio

    async def run() -> tuple[int, list[np.ndarray]]:
        async with AsyncClient(small_messages, shared_memory="on", timeout=30) as c:
            await c.create_group(
                "a", Adam(), learning_rate=0.01, tensors={"w": W0, "b": B0}
            )
            t = await c.push("a", G[0], GB[0])
            return t, await c.pull("a")

    t, (w, b) = asyncio.run(run())
    with Client(small_messages, shared_memory="off", transport="stream") as c:
        assert c.pull("a")[0].tobytes() == w.tobytes()
    assert t == 1
    assert segments_of(os.getpid()) == []


def test_a_server_with_shared_memory_off_is_refused_cleanly(
    servers: Callable[..., ServerHandle],
    caplog: pytest.LogCaptureFixture,
) -> None:
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", shared_memory="off")
    )
    with Client(handle.address, shared_memory="on", timeout=10) as on:
        on.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0})
        with pytest.raises(SharedMemoryError, match="shared memory turned off"):
            on.push("g", G[0])
        assert on.describe_group("g").update_count == 0
    with caplog.at_level(logging.INFO, "onnxps.client"):
        with Client(handle.address, timeout=10) as auto:  # "auto": falls back
            assert auto.push("g", G[0]) == 1
            assert auto.push("g", G[1]) == 2
    fallbacks = [r for r in caplog.records if "not possible" in r.getMessage()]
    assert len(fallbacks) == 1  # one log line, not one per call
    assert "sending tensor bytes over gRPC" in fallbacks[0].getMessage()
    handle.stop(grace=0)
    assert segments_of(os.getpid()) == []


def test_shared_memory_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="shared_memory must be one of auto, on, off"):
        Client("127.0.0.1:1", shared_memory="yes")  # type: ignore[arg-type]


# -- refusals: hand-made requests, server state unchanged ------------------------
@pytest.fixture
def raw(
    small_messages: str,
) -> Iterator[tuple[Stub, str]]:
    with Client(small_messages, shared_memory="off") as c:
        _create(c, "g")
    with grpc.insecure_channel(small_messages) as ch:
        yield pb_grpc.ParameterServerServiceStub(ch), small_messages


def _state(address: str) -> list[bytes]:
    with Client(address, shared_memory="off", transport="stream") as c:
        t, arrays = c.pull_versioned("g", state=True)
    return [str(t).encode()] + [a.tobytes() for a in arrays]


def _push(
    stub: Stub,
    region: pb.SharedMemoryRegion,
    grads: list[np.ndarray] | None = None,
    **kw: object,
) -> pb.PushResponse:
    req = pb.PushRequest(
        group="g",
        gradients=[header_tensor(a) for a in grads or [G[0], GB[0]]],
        gradients_region=region,
        **kw,  # type: ignore[arg-type]
    )
    return stub.Push(req, timeout=10)


def _refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value


@pytest.mark.parametrize(
    "name",
    ["../../etc/passwd", "onnxps-../x", "/dev/shm/onnxps-1-a", "other-1-a", "onnxps-"],
)
def test_a_segment_name_outside_the_prefix_is_invalid(
    raw: tuple[Stub, str], name: str
) -> None:
    stub, address = raw
    before = _state(address)
    region = pb.SharedMemoryRegion(segment=name, generation=1, offsets=[64, 64])
    err = _refused(lambda: _push(stub, region))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a shared-memory segment of onnxps" in (err.details() or "")
    hello = _refused(
        lambda: stub.SharedMemoryHello(
            pb.SharedMemoryHelloRequest(segment=name), timeout=10
        )
    )
    assert hello.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _state(address) == before


def test_truncated_wrong_size_and_stale_segments_are_refused(
    raw: tuple[Stub, str],
) -> None:
    stub, address = raw
    before = _state(address)
    good = Segment(64 + G[0].nbytes + 256)
    try:
        region = good.write([G[0], GB[0]])
        # the segment holds fewer bytes than the gradients need
        short = Segment(64 + G[0].nbytes // 2)
        short_region = short.write([G[0][: N // 4], GB[0]])
        short_region.offsets[:] = region.offsets
        err = _refused(lambda: _push(stub, short_region))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the segment is truncated" in (err.details() or "")
        short.close()
        # truncated after it was written
        os.truncate(good.path, 4096)
        err = _refused(lambda: _push(stub, region))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "truncated" in (err.details() or "")
        os.truncate(good.path, good.size)
        region = good.write([G[0], GB[0]])
        # a generation that is not the segment's: stale or rewritten
        stale = pb.SharedMemoryRegion()
        stale.CopyFrom(region)
        stale.generation -= 1
        err = _refused(lambda: _push(stub, stale))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "generation" in (err.details() or "")
        # an offset per gradient
        bad = pb.SharedMemoryRegion(
            segment=good.name, generation=region.generation, offsets=[64]
        )
        err = _refused(lambda: _push(stub, bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1 offsets for 2 tensors" in (err.details() or "")
        # a segment that does not exist
        gone = pb.SharedMemoryRegion(segment="onnxps-1-nosuch", offsets=[64, 64])
        err = _refused(lambda: _push(stub, gone))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot open segment" in (err.details() or "")
        # validation is unchanged: a NaN gradient in the segment steps nothing
        nan = G[0].copy()
        nan[5] = np.nan
        nan_region = good.write([nan, GB[0]])
        err = _refused(lambda: _push(stub, nan_region, [nan, GB[0]]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "NaN or inf" in (err.details() or "")
        # and a region with bytes inline too is ambiguous
        both = pb.PushRequest(
            group="g",
            gradients=[
                pb.Tensor(
                    dtype=pb.DATA_TYPE_FLOAT, dims=[N], raw_data=G[0][:33].tobytes()
                ),
                pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=list(GB[0].shape)),
            ],
            gradients_region=region,
        )
        err = _refused(lambda: stub.Push(both, timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.details() or "").startswith(
            "gradient 1 carries bytes inline and in gradients_region: with a region "
            "or a transfer, raw_data must be empty"
        )
        assert _state(address) == before
    finally:
        good.close()


def test_exactly_once_holds_through_shared_memory(
    raw: tuple[Stub, str],
) -> None:
    stub, address = raw
    seg = Segment(64 + G[0].nbytes + 256)
    try:
        region = seg.write([G[0], GB[0]])
        first = _push(stub, region, client_id="w", seq=7)
        again = _push(stub, region, client_id="w", seq=7)
        assert (first.update_count, first.duplicate) == (1, False)
        assert (again.update_count, again.duplicate) == (1, True)
        assert _state(address)[0] == b"1"
    finally:
        seg.close()


def test_a_segment_of_another_user_is_permission_denied(
    raw: tuple[Stub, str],
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a segment to another uid")
    stub, address = raw
    before = _state(address)
    seg = Segment(64 + G[0].nbytes + 256)
    hello, _ = hello_segment()
    try:
        region = seg.write([G[0], GB[0]])
        os.chown(seg.path, 65534, 65534)
        os.chown(hello.path, 65534, 65534)
        err = _refused(lambda: _push(stub, region))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "belongs to uid 65534" in (err.details() or "")
        err = _refused(
            lambda: stub.SharedMemoryHello(
                pb.SharedMemoryHelloRequest(segment=hello.name), timeout=10
            )
        )
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _state(address) == before
    finally:
        seg.close()
        hello.close()


_OTHER_USER = textwrap.dedent(
    """
    import os, sys
    import grpc
    import numpy as np
    from onnxps.client import Client, SharedMemoryError
    # what grpc imports lazily, imported while this process may read the checkout
    # (a clone in a 0700 directory is not readable by uid 65534)
    grpc.insecure_channel(sys.argv[1]).close()
    os.setgid(65534)
    os.setuid(65534)
    g = np.ones(1 << 20, np.float32)
    with Client(sys.argv[1], shared_memory="on", timeout=10) as c:
        try:
            c.push("g", g, np.ones(33, np.float32))
        except SharedMemoryError as exc:
            print("REFUSED", exc)
    with Client(sys.argv[1], timeout=10) as c:  # "auto" falls back to bytes
        print("T", c.push("g", g, np.ones(33, np.float32)))
    """
)


def test_a_client_of_another_uid_is_refused_and_falls_back(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
) -> None:
    """A real client process that runs as uid 65534 (nobody): its hello segment
    is not the server's user's, so the server refuses shared memory."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    handle = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    with Client(handle.address) as c:
        _create(c, "g")
    script = tmp_path / "other.py"
    script.write_text(_OTHER_USER)
    out = subprocess.run(
        [sys.executable, str(script), handle.address],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED" in out.stdout
    assert "belongs to uid 65534" in out.stdout
    assert "T 1" in out.stdout


def test_tokens_still_apply(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("admin-token-0123456789 admin *\n")
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", tokens_file=str(tokens))
    )
    with Client(
        handle.address, token="admin-token-0123456789", shared_memory="on"
    ) as c:
        _create(c, "g")
        assert c.push("g", G[0], GB[0]) == 1
    with Client(handle.address, shared_memory="on") as anonymous:
        with pytest.raises(UnauthenticatedError):
            anonymous.push("g", G[0], GB[0])
    with grpc.insecure_channel(handle.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        hello, _ = hello_segment()
        try:
            err = _refused(
                lambda: stub.SharedMemoryHello(
                    pb.SharedMemoryHelloRequest(segment=hello.name), timeout=10
                )
            )
        finally:
            hello.close()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_sync_groups_buffer_a_copy_of_the_segment(small_messages: str) -> None:
    """A sync push is buffered until the quorum: it must not keep viewing the
    client's segment, which the next call rewrites."""
    with (
        Client(small_messages, shared_memory="on", client_id="a") as a,
        Client(small_messages, shared_memory="on", client_id="b") as b,
        Client(small_messages, shared_memory="off", client_id="c") as wire_a,
        Client(small_messages, shared_memory="off", client_id="d") as wire_b,
    ):
        _create(a, "s", consistency=Sync(2))
        _create(wire_a, "w", consistency=Sync(2))
        assert a.push_detailed("s", G[0], GB[0]).applied is False
        # a's pool segment is rewritten by its next push to another group
        _create(a, "other")
        a.push("other", G[2], GB[2])
        assert b.push_detailed("s", G[1], GB[1]).applied is True
        wire_a.push("w", G[0], GB[0])
        wire_b.push("w", G[1], GB[1])
        got = a.pull("s", state=True)
        want = wire_a.pull("w", state=True)
        assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))


# -- kill -9: no segment left behind ---------------------------------------------
_PUSHER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from onnxps.client import Client
    g = np.ones(1 << 20, np.float32)
    with Client(sys.argv[1], shared_memory="on", timeout=5) as c:
        c.push("g", g, np.ones(33, np.float32), return_values=True)
        print("PUSHED", flush=True)
        while True:
            c.push("g", g, np.ones(33, np.float32), return_values=True)
    """
)


def _start_pusher(tmp_path: Path, address: str) -> subprocess.Popen[str]:
    script = tmp_path / "pusher.py"
    script.write_text(_PUSHER)
    proc = subprocess.Popen(
        [sys.executable, str(script), address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "PUSHED", proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.mark.slow
def test_a_killed_client_leaves_no_segment_once_the_server_sweeps(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    server, address = server_processes(tmp_path / "server.log")
    with Client(address, shared_memory="off") as c:
        _create(c, "g")
    client = _start_pusher(tmp_path, address)
    assert segments_of(client.pid)  # its segments exist while it runs
    client.kill()
    client.communicate()  # reaps it and closes its pipes
    assert wait_until(lambda: segments_of(client.pid) == [])
    assert server.poll() is None
    with Client(address, shared_memory="off") as c:
        assert c.describe_group("g").update_count >= 1


@pytest.mark.slow
def test_a_killed_server_leaves_no_segment_once_the_client_notices(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    server, address = server_processes(tmp_path / "server.log")
    with Client(address, shared_memory="on", timeout=3) as c:
        _create(c, "g")
        assert c.push("g", G[0], GB[0]) == 1
        assert segments_of(os.getpid())
        server.kill()
        server.wait()
        with pytest.raises(Exception, match="unavailable|within 3 s"):
            c.push("g", G[1], GB[1])
        # the client noticed: it unlinked its segments at once
        assert segments_of(os.getpid()) == []


def test_a_server_sweeps_orphans_at_start(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    done = subprocess.Popen(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = int(done.communicate()[0])  # it has exited: its pid is dead
    orphan = Path(SHM_DIR) / f"onnxps-{pid}-deadbeef"
    orphan.write_bytes(MAGIC + struct.pack("<Q", 1))
    servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    try:
        assert not orphan.exists()
    finally:
        orphan.unlink(missing_ok=True)


def test_a_reply_region_too_small_gets_the_tensors_inline(
    server: ServerHandle,
) -> None:
    w0 = np.arange(100, dtype=np.float32)
    with Client(server.address, shared_memory="off") as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": w0})
    small, large = Segment(128), Segment(4096)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            inline = stub.Pull(
                pb.PullRequest(group="g", reply_region=small.region()), timeout=10
            )
            shared = stub.Pull(
                pb.PullRequest(group="g", reply_region=large.region()), timeout=10
            )
        assert not inline.HasField("tensors_region")
        assert np.frombuffer(inline.tensors[0].raw_data, np.float32).tolist() == (
            w0.tolist()
        )
        assert shared.HasField("tensors_region")
        assert shared.tensors[0].raw_data == b""
        (w,) = large.read(shared.tensors_region, shared.tensors)
        assert w.tolist() == w0.tolist()
        assert shared.tensors_region.generation == 1
    finally:
        small.close()
        large.close()


_NO_ROOM = textwrap.dedent(
    """
    import logging, resource, signal, sys
    import numpy as np
    from onnxps.client import Client, SharedMemoryError
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    # files of at most 1 MiB: a segment for 4 MiB finds no room, as in a full
    # /dev/shm (a container's is often 64 MiB)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    g = np.ones(1 << 20, np.float32)
    with Client(sys.argv[1], shared_memory="on", timeout=10) as c:
        try:
            c.push("g", g, np.ones(33, np.float32))
        except SharedMemoryError as exc:
            print("REFUSED", exc)
    with Client(sys.argv[1], timeout=10) as c:
        print("T", c.push("g", g, np.ones(33, np.float32)))
        print("PULLED", c.pull("g")[0].shape)
    """
)


def test_no_room_in_dev_shm_falls_back_to_grpc_bytes(
    server: ServerHandle, tmp_path: Path
) -> None:
    with Client(server.address, shared_memory="off") as c:
        _create(c, "g")
    script = tmp_path / "no_room.py"
    script.write_text(_NO_ROOM)
    out = subprocess.run(
        [sys.executable, str(script), server.address],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED no room in /dev/shm for 4194436 bytes" in out.stdout
    assert "this call sends its tensors over gRPC" in out.stdout
    assert "T 1" in out.stdout
    assert "PULLED (1048576,)" in out.stdout


def test_packed_and_aligned_regions_step_alike(small_messages: str) -> None:
    """The client packs one dtype's tensors back to back in its segment (one flat
    span: the server checks and steps the group as one array); a region whose
    tensors start 64-byte aligned (as clients wrote them before) is stepped alike,
    bit for bit as the same push over gRPC."""
    grads = [[GB[k], G[k]] for k in range(2)]  # 33 elements first: 132 bytes
    with Client(small_messages, shared_memory="off") as c:
        for name in ("packed", "aligned", "bytes"):
            c.create_group(name, Adam(), learning_rate=0.01, tensors={"b": B0, "w": W0})
        for g in grads:
            c.push("bytes", *g)
    seg = Segment(64 + 256 + G[0].nbytes)
    try:
        with grpc.insecure_channel(small_messages) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            for g in grads:
                headers = [header_tensor(a) for a in g]
                packed = seg.write(g)
                assert list(packed.offsets) == [64, 64 + 132]
                req = pb.PushRequest(
                    group="packed", gradients=headers, gradients_region=packed
                )
                assert stub.Push(req, timeout=30).applied
                seg.map[64 : 64 + 132] = g[0].tobytes()
                seg.map[256 : 256 + g[1].nbytes] = g[1].tobytes()
                aligned = seg.publish([64, 256])
                req = pb.PushRequest(
                    group="aligned", gradients=headers, gradients_region=aligned
                )
                assert stub.Push(req, timeout=30).applied
        with Client(small_messages, shared_memory="off", transport="stream") as c:
            states = {
                name: c.pull_versioned(name, state=True)
                for name in ("packed", "aligned", "bytes")
            }
    finally:
        seg.close()
    t, want = states["bytes"]
    assert t == 2
    for name in ("packed", "aligned"):
        got_t, got = states[name]
        assert got_t == 2
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


# -- one segment a call, given back after it --------------------------------------
def _x_after(address: str) -> list[np.ndarray]:
    with Client(address, shared_memory="off", transport="stream") as c:
        return c.pull("g")


def test_a_push_returning_x_writes_x_over_its_gradients_and_a_resend_is_answered_once(
    raw: tuple[Stub, str],
) -> None:
    stub, address = raw
    seg = Segment(64 + G[0].nbytes + 256)
    try:
        region = seg.write([G[0], GB[0]])
        # one segment for the call: X comes back where the gradients were
        first = _push(
            stub,
            region,
            client_id="w",
            seq=7,
            return_values=True,
            reply_region=seg.region(),
        )
        assert (first.update_count, first.duplicate) == (1, False)
        assert first.values_region.segment == seg.name
        assert first.values_region.generation == region.generation + 1
        assert list(first.values_region.offsets) == list(region.offsets)
        x1 = [a.copy() for a in seg.read(first.values_region, first.values)]
        pulled = _x_after(address)
        assert all(np.array_equal(a, b) for a, b in zip(x1, pulled, strict=True))
        assert not np.array_equal(x1[0], W0)
        # the reply was lost: the client resends the same request, whose region
        # names the gradients' generation; they are spent (X is there), and the
        # push is answered from the exactly-once window, X written again
        seg.map[64 : 64 + 16] = b"\0" * 16  # the client's copy of X, scribbled
        again = _push(
            stub,
            region,
            client_id="w",
            seq=7,
            return_values=True,
            reply_region=region_at(seg, region.generation),
        )
        assert (again.update_count, again.duplicate) == (1, True)
        x2 = seg.read(again.values_region, again.values)
        assert all(np.array_equal(a, b) for a, b in zip(x1, x2, strict=True))
        assert _state(address)[0] == b"1"
        # a push whose spent gradients the window does not hold (another client,
        # say) is refused: X is never stepped as a gradient
        before = _state(address)
        err = _refused(
            lambda: _push(
                stub,
                region,
                client_id="other",
                seq=1,
                return_values=True,
                reply_region=region_at(seg, region.generation),
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already holds X of an earlier answer" in (err.details() or "")
        assert _state(address) == before
        # the reply in the gradients' segment at another generation: refused
        # before anything is applied (X would go over the gradients)
        fresh = seg.write([G[1], GB[1]])
        err = _refused(
            lambda: _push(
                stub,
                fresh,
                client_id="w",
                seq=9,
                return_values=True,
                reply_region=region_at(seg, fresh.generation - 1),
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at another generation" in (err.details() or "")
        assert _state(address) == before
        # a push without the reply in its segment still finds it stale
        err = _refused(lambda: _push(stub, region, client_id="w", seq=8))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not at the generation the call names" in (err.details() or "")
    finally:
        seg.close()


def region_at(seg: Segment, generation: int) -> pb.SharedMemoryRegion:
    """``seg`` as a reply region at ``generation`` (what a resent request holds)."""
    return pb.SharedMemoryRegion(segment=seg.name, generation=generation, key=seg.key)


def test_a_client_push_returning_x_uses_one_segment(small_messages: str) -> None:
    with Client(small_messages, shared_memory="on", timeout=30) as c:
        _create(c, "g")
        x = c.push("g", G[0], GB[0], return_values=True)
        assert len(segments_of(os.getpid())) == 1
        assert all(np.array_equal(a, b) for a, b in zip(x, c.pull("g"), strict=True))
        assert len(segments_of(os.getpid())) == 1  # the pull took it again


def _shared_mib(pid: int) -> float:
    """The server's resident shared memory (RssShmem), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssShmem in /proc/PID/status")


@pytest.mark.slow
def test_the_server_maps_one_group_of_segments_and_gives_it_back(
    tmp_path: Path, server_processes: StartServer
) -> None:
    """docs/transports.md: a push returning X maps one segment the size of the
    group in the server, and the server's RSS holds no client segment once its
    calls are over (IDLE_SECONDS)."""
    proc, address = server_processes(
        tmp_path / "server.log", env=clean_env(ONNXPS_KERNELS="numpy")
    )
    n = 8 << 20  # 32 MiB of float32
    grads = [RNG.standard_normal(n).astype(np.float32) for _ in range(4)]
    with (
        Client(address, shared_memory="on", timeout=60) as c,
        Client(address, shared_memory="off", timeout=60) as ref,
    ):
        for client, name in ((c, "big"), (ref, "ref")):
            client.create_group(
                name,
                Adam(),
                learning_rate=1e-3,
                tensors={"w": np.zeros(n, np.float32)},
            )
        base = _shared_mib(proc.pid)
        for g in grads[:2]:
            c.push("big", g)
            ref.push("ref", g)
            c.pull("big")
            # one segment of the group's size (+1/32): not two
            assert _shared_mib(proc.pid) - base < 40
        (x,) = c.push("big", grads[2], return_values=True)
        assert _shared_mib(proc.pid) - base < 40
        (want,) = ref.push("ref", grads[2], return_values=True)
        assert np.array_equal(x, want)
        assert wait_until(lambda: _shared_mib(proc.pid) - base < 2, 10)
        # the segment's pages dropped from the server are the client's still:
        # the next push reads its gradients from them, as over gRPC
        (x,) = c.push("big", grads[3], return_values=True)
        (want,) = ref.push("ref", grads[3], return_values=True)
        assert np.array_equal(x, want)


@pytest.mark.slow
def test_shared_memory_idle_seconds_keeps_a_segment_mapped_that_long(
    tmp_path: Path, server_processes: StartServer
) -> None:
    """docs/transports.md: --shared-memory-idle-seconds sets how long a segment's
    pages stay in the server after its last call (default 1 s): at 3,600 they are
    still mapped 4 s after the call, and the next push is exact; 0 is refused
    before the server starts."""
    proc, address = server_processes(
        tmp_path / "server.log",
        "--shared-memory-idle-seconds",
        "3600",
        env=clean_env(ONNXPS_KERNELS="numpy"),
    )
    n = 8 << 20  # 32 MiB of float32
    g = RNG.standard_normal(n).astype(np.float32)
    with (
        Client(address, shared_memory="on", timeout=60) as c,
        Client(address, shared_memory="off", timeout=60) as ref,
    ):
        for client, name in ((c, "big"), (ref, "ref")):
            client.create_group(
                name, Adam(), learning_rate=1e-3, tensors={"w": np.zeros(n, np.float32)}
            )
        base = _shared_mib(proc.pid)
        c.push("big", g)
        ref.push("ref", g)
        assert _shared_mib(proc.pid) - base > 30
        time.sleep(4)  # four times the default: the default drops them by now
        assert _shared_mib(proc.pid) - base > 30
        (x,) = c.push("big", g, return_values=True)
        (want,) = ref.push("ref", g, return_values=True)
        assert np.array_equal(x, want)
    bad = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--shared-memory-idle-seconds",
         "0", "--address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert bad.returncode != 0
    assert "shared_memory_idle_seconds must be a finite number > 0, got 0.0" in (
        bad.stderr
    )


def test_the_segments_a_call_maps_count_in_the_inflight_budget(
    servers: Any,
) -> None:
    """docs/transports.md: a call's segments count in --max-inflight-bytes while
    it runs, X over the gradients adding nothing."""
    handle = servers(max_inflight_bytes=6 << 20)
    with Client(handle.address, shared_memory="off") as c:
        _create(c, "g")
    grads, reply = Segment(64 + G[0].nbytes + 256), Segment(64 + G[0].nbytes + 256)
    big = Segment(8 << 20)
    try:
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            region = grads.write([G[0], GB[0]])
            # gradients and X in two segments: 2 x 4 MiB, over the 6 MiB budget
            err = _refused(
                lambda: _push(
                    stub, region, return_values=True, reply_region=reply.region()
                )
            )
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this push's shared-memory segments map 8388872 bytes" in (
                err.details() or ""
            )
            # X over the gradients: one segment, within it
            done = _push(stub, region, return_values=True, reply_region=grads.region())
            assert done.update_count == 1 and done.values_region.segment == grads.name
            # a pull holds the segment it writes into (8 MiB here: over)
            err = _refused(
                lambda: stub.Pull(
                    pb.PullRequest(group="g", reply_region=big.region()), timeout=10
                )
            )
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this pull's shared-memory segment maps 8388608 bytes" in (
                err.details() or ""
            )
            got = stub.Pull(
                pb.PullRequest(group="g", reply_region=reply.region()), timeout=10
            )
            assert got.HasField("tensors_region") and got.update_count == 1
            # the budget is whole again once the calls ended
            again = _push(
                stub,
                grads.write([G[1], GB[1]]),
                return_values=True,
                reply_region=grads.region(),
            )
            assert again.update_count == 2
    finally:
        for seg in (grads, reply, big):
            seg.close()


def test_a_segment_with_holes_is_refused_before_the_server_maps_it(
    raw: tuple[Stub, str],
) -> None:
    """docs/transports.md: a segment must be allocated whole (the client's are,
    posix_fallocate). One grown with ftruncate has holes, which the server's
    mapping would fill in /dev/shm: memory the client never paid for, outside
    --max-inflight-bytes, and a SIGBUS in the server where /dev/shm is full. Such a
    segment is refused (BAD_SEGMENT), with nothing allocated, read or stepped."""
    stub, address = raw
    before = _state(address)
    seg = Segment(64 + G[0].nbytes + 256)
    try:
        region = seg.write([G[0], GB[0]])
        allocated = os.stat(seg.path).st_blocks * 512
        os.truncate(seg.path, 64 << 20)  # 60 MiB more, none of it allocated
        calls: list[Callable[[], Any]] = [
            lambda: _push(stub, region),
            lambda: _push(stub, region, return_values=True, reply_region=seg.region()),
            lambda: stub.Pull(
                pb.PullRequest(group="g", reply_region=seg.region()), timeout=10
            ),
        ]
        for call in calls:
            err = _refused(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"segment {seg.name!r} has 67108864 bytes, of which " in (
                err.details() or ""
            )
            assert "allocate it whole (posix_fallocate)" in (err.details() or "")
            assert os.stat(seg.path).st_blocks * 512 == allocated
        assert _state(address) == before
        # allocated whole, the same segment serves
        fd = os.open(seg.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, 64 << 20)
        finally:
            os.close(fd)
        assert _push(stub, region).update_count == 1
        # mapped and cached now: a hole punched after that is refused at the next
        # call too (every call checks the file), with nothing stepped
        _punch_hole(seg.path, 32 << 20, 4 << 20)
        after = _state(address)
        for call in calls:
            err = _refused(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"segment {seg.name!r} has 67108864 bytes, of which " in (
                err.details() or ""
            )
        assert _state(address) == after
    finally:
        seg.close()


def _punch_hole(path: str, offset: int, length: int) -> None:
    """Deallocate ``length`` bytes of ``path`` at ``offset``, its size kept
    (fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, 0x02 | 0x01, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)
    assert os.stat(path).st_blocks * 512 < os.stat(path).st_size


def _race(
    stub: Stub,
    group: str,
    g: np.ndarray,
    over: bool = True,
    resent: bool = False,
    seq: int = 1,
) -> list[Any]:
    """Two pushes of ``g`` at once (two workers, or with ``resent`` one push sent
    twice), through one segment, each writing X over it (``over``) or only
    reading it: what each was answered (T, or the refusal's reason)."""
    seg = Segment(64 + g.nbytes)
    try:
        region = seg.write([g])
        start = threading.Barrier(2)
        outcomes: list[Any] = [None, None]

        def push(k: int) -> None:
            req = pb.PushRequest(
                group=group,
                gradients=[header_tensor(g)],
                gradients_region=region,
                reply_region=seg.region() if over else None,
                return_values=over,
                client_id="worker" if resent else f"worker{k}",
                seq=seq,
            )
            start.wait()
            try:
                outcomes[k] = stub.Push(req, timeout=30).update_count
            except grpc.RpcError as exc:
                outcomes[k] = translate(exc).reason

        threads = [threading.Thread(target=push, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(outcomes, key=str)
    finally:
        seg.close()


@pytest.mark.slow
def test_two_pushes_at_once_through_one_segment_never_step_x_as_gradients(
    servers: Any,
) -> None:
    """docs/transports.md: a push writing X over its gradients has their segment
    to itself while it runs. Two pushes naming one segment at once (a client
    bug), one of which writes X there, step one of them: the other is refused
    (FAILED_PRECONDITION SEGMENT_BUSY while the first runs, STALE_SEGMENT once it
    wrote X) and never steps X as its gradients."""
    handle = servers(ServerConfig(address="127.0.0.1:0", durability="none"))
    n, trials = N, 16
    g = np.full(n, 0.5, np.float32)
    with Client(handle.address, shared_memory="off") as c:
        for i in range(trials):
            c.create_group(f"g{i}", Adam(), learning_rate=0.01, tensors={"w": W0[:n]})
        c.create_group("ref", Adam(), learning_rate=0.01, tensors={"w": W0[:n]})
        c.push("ref", g)
        want = [a.tobytes() for a in c.pull("ref", state=True)]
    seen = set()
    with grpc.insecure_channel(handle.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        for i in range(trials):
            outcomes = _race(stub, f"g{i}", g)
            seen.add(outcomes[1])
            assert outcomes in ([1, "SEGMENT_BUSY"], [1, "STALE_SEGMENT"]), outcomes
            with Client(handle.address, shared_memory="off") as c:
                assert c.describe_group(f"g{i}").update_count == 1
                got = [a.tobytes() for a in c.pull(f"g{i}", state=True)]
            assert got == want, f"trial {i}: the group stepped something but G"
        # pushes that only read the segment run at once: both step
        assert _race(stub, "ref", g, over=False) == [2, 3]
        # a push resent while its first call runs is answered once, not refused
        with Client(handle.address, shared_memory="off") as c:
            c.create_group("resent", Adam(), learning_rate=0.01, tensors={"w": W0})
        for t in range(1, 9):
            assert _race(stub, "resent", g, resent=True, seq=t) == [t, t]
    assert "SEGMENT_BUSY" in seen  # the pushes did run at once
