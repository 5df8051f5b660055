"""A graceful stop (SIGTERM) never hands a client a raw CANCELLED: calls in flight
finish, new ones are answered UNAVAILABLE and retried, and pushes apply exactly once
across stops and restarts of the server."""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _procs import StartServer, clean_env
from onnxps.client import Adagrad, Client, UnavailableError
from onnxps.server.app import ServerHandle

RESTARTS = 3


def _loop(
    address: str,
    transport: str,
    stop_at: threading.Event,
    acked: list[int],
    errors: list[BaseException],
) -> None:
    n = (1 << 18) if transport == "stream" else 16
    grad = np.ones(n, np.float32)
    try:
        # A generous deadline: each restart must fit in it, on a loaded machine too.
        with Client(address, timeout=60, transport=transport) as c:  # type: ignore[arg-type]
            while not stop_at.is_set():
                c.push(f"g-{transport}", grad)
                acked.append(1)
    except BaseException as exc:  # noqa: BLE001 - asserted below
        errors.append(exc)


def _wait_acked(
    acked: dict[str, list[int]], errors: list[BaseException], more: int = 3
) -> None:
    """Until each transport has ``more`` pushes acknowledged beyond its count now."""
    want = {t: len(a) + more for t, a in acked.items()}
    deadline = time.monotonic() + 60
    while any(len(acked[t]) < n for t, n in want.items()):
        counts = {t: len(a) for t, a in acked.items()}
        assert time.monotonic() < deadline, f"pushes stuck at {counts}: {errors}"
        time.sleep(0.01)


@pytest.mark.slow
def test_push_loops_survive_sigterm_and_restarts_exactly_once(
    server_processes: StartServer, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    args = ("--data-dir", str(data), "--durability", "snapshot")
    proc, address = server_processes(tmp_path / "s0.log", *args)
    port_args = ("--address", address)
    with Client(address, timeout=10) as c:
        for transport, n in (("unary", 16), ("stream", 1 << 18)):
            c.create_group(
                f"g-{transport}",
                Adagrad(),
                learning_rate=0.1,
                tensors={"x": np.zeros(n, np.float32)},
            )
    stop_at = threading.Event()
    acked: dict[str, list[int]] = {"unary": [], "stream": []}
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_loop, args=(address, t, stop_at, acked[t], errors))
        for t in ("unary", "unary", "unary", "stream")
    ]
    for t in threads:
        t.start()
    try:
        for run in range(1, RESTARTS + 1):
            _wait_acked(acked, errors)  # this server takes pushes of both kinds
            proc.terminate()
            assert proc.wait(30) == 0
            assert "Traceback" not in (tmp_path / f"s{run - 1}.log").read_text()
            proc, again = server_processes(tmp_path / f"s{run}.log", *args, *port_args)
            assert again == address
        _wait_acked(acked, errors)
        stop_at.set()
        for t in threads:
            t.join(60)
        assert errors == []
        with Client(address, timeout=10) as c:
            for transport in ("unary", "stream"):
                t_now = c.describe_group(f"g-{transport}").update_count
                # every acknowledged push applied, none twice
                assert t_now == len(acked[transport]) > 0
    finally:
        stop_at.set()


@pytest.mark.slow
def test_push_raises_unavailable_when_the_server_never_returns(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    proc, address = server_processes(tmp_path / "s.log")
    with Client(address, timeout=10) as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(4)})
        proc.terminate()
        assert proc.wait(30) == 0
        with pytest.raises(UnavailableError) as err:
            c.push("g", np.ones(4), timeout=2)
    message = str(err.value)
    assert f"the server at {address} stayed unavailable for 2 s" in message
    assert "may not have been applied" in message


def test_stop_finishes_admitted_calls_and_refuses_new_ones_with_unavailable(
    servers: Callable[..., ServerHandle],
) -> None:
    """In process: a call the server is running when stop starts gets its answer;
    a call that arrives afterwards gets UNAVAILABLE, never CANCELLED."""
    handle = servers()
    x = np.zeros(1 << 20, np.float32)
    with Client(handle.address, timeout=10) as c:
        c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"x": x})
    release = threading.Event()
    outcome: dict[str, object] = {}

    def slow_chunks() -> Iterator[Any]:
        from onnxps.v1 import parameter_server_pb2 as pb
        from onnxps.wire.codec import header_tensor, iter_chunks

        header = pb.PushRequest(group="big", client_id="slow", seq=1)
        header.gradients.append(header_tensor(x))
        yield pb.PushStreamRequest(header=header)
        for i, chunk in enumerate(iter_chunks([np.ones_like(x)], 1 << 20)):
            if i == 1:
                outcome["started"] = True
                release.wait(10)
            yield pb.PushStreamRequest(chunk=chunk)

    def slow_push() -> None:
        from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

        with grpc.insecure_channel(handle.address) as ch:
            try:
                stub = pb_grpc.ParameterServerServiceStub(ch)
                outcome["reply"] = stub.PushStream(slow_chunks(), timeout=20)
            except grpc.RpcError as exc:
                outcome["error"] = exc.code()
            except Exception as exc:  # noqa: BLE001 - a broken test, asserted below
                outcome["error"] = exc

    pusher = threading.Thread(target=slow_push)
    pusher.start()
    deadline = time.monotonic() + 20
    while not outcome.get("started") and "error" not in outcome:
        assert time.monotonic() < deadline, "the slow push never started"
        time.sleep(0.01)
    stopper = threading.Thread(target=handle.stop, kwargs={"grace": 10.0})
    stopper.start()
    deadline = time.monotonic() + 20
    while handle.gate._idle_waiters == 0:  # stop waits for the slow push to end
        assert time.monotonic() < deadline, "the stop never waited for the push"
        assert handle.gate.running, "the slow push ended before the stop waited"
        time.sleep(0.01)
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    with grpc.insecure_channel(handle.address) as ch:
        with pytest.raises(grpc.RpcError) as late:
            pb_grpc.ParameterServerServiceStub(ch).ListGroups(
                pb.ListGroupsRequest(), timeout=5
            )
    release.set()
    pusher.join(20)
    stopper.join(20)
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (late.value.details() or "")
    assert "error" not in outcome, outcome.get("error")
    assert outcome["reply"].update_count == 1  # type: ignore[attr-defined]


@pytest.mark.slow
def test_demo_worker_exits_3_with_one_line_when_the_server_stops(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    import subprocess

    proc, address = server_processes(tmp_path / "s.log")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "onnxps.cli._demo_worker",
            f"--address={address}",
            "--steps=100000",
            "--timeout=2",
            "--log-every=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert worker.stdout is not None
    for line in worker.stdout:
        if "step 20/" in line:
            break
    proc.terminate()
    assert proc.wait(30) == 0
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 3, err
    lines = [x for x in err.splitlines() if "resending" not in x]
    assert len(lines) == 1, err
    assert "unreachable or gone" in lines[0]
    assert "Traceback" not in err


_TGKILL = {"x86_64": 234, "aarch64": 131}


@pytest.mark.slow
@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in _TGKILL,
    reason="sends a signal to one thread with Linux's tgkill",
)
def test_a_sigterm_delivered_to_any_thread_stops_the_server(
    server_processes: StartServer, tmp_path: Path
) -> None:
    """The kernel hands a process's SIGTERM to any of its threads (gRPC's, numba's);
    Python runs the handler only in the main thread, so the main thread must not
    sleep in an untimed wait that only a signal to itself would interrupt. Sent to
    every thread but the main one in turn, the stop happens each time."""
    libc = ctypes.CDLL(None, use_errno=True)
    log = tmp_path / "s.log"
    proc, address = server_processes(log)
    with Client(address, timeout=10) as c:  # the server's threads are all up
        x = {"x": np.zeros(4)}
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors=x)
    tids = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
    others = [t for t in tids if t != proc.pid]
    assert others, "the server runs threads besides its main thread"
    assert libc.syscall(_TGKILL[platform.machine()], proc.pid, others[-1], 15) == 0
    assert proc.wait(15) == 0
    assert "received SIGTERM: draining in-flight calls" in log.read_text()
