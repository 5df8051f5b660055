"""Callers that wait, read slowly or leave cannot take the server's threads or memory.

Waits (a pull with min_version, a sync push asking for its values) end when their
caller leaves and are bounded below the thread pool; slow pullers share one copy per
version and are counted against the in-flight bytes; a push cut off by its client
is released at once and is not logged as a server bug.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _procs import StartServer, clean_env
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.client import Adagrad, Client, Sync
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.server.interceptors.security import ConfigError
from onnxps.server.kernels import make_attrs
from onnxps.server.store import CallCancelled, Cancellation, ParameterStore
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import header_tensor, iter_chunks

MIB = 1 << 20
FOREVER = 2**62


def _until(probe: Callable[[], bool], seconds: float = 30.0) -> None:
    """Wait until ``probe()`` holds; fails after a generous ``seconds``."""
    deadline = time.monotonic() + seconds
    while not probe():
        assert time.monotonic() < deadline, f"condition never held in {seconds} s"
        time.sleep(0.01)


def _answers_while_held(handle: ServerHandle, c: Client, group: str) -> None:
    """A push and a health check are served (each within its own deadline) while
    the waits are held."""
    t = c.describe_group(group).update_count
    assert c.push(group, np.ones(4, np.float32), timeout=5) == t + 1
    with grpc.insecure_channel(handle.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _code(f: grpc.Future[Any]) -> grpc.StatusCode | None:
    try:
        f.result(timeout=0)
    except grpc.FutureTimeoutError:
        return None
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    return grpc.StatusCode.OK


def test_waiting_is_bounded_below_the_thread_pool(
    servers: Callable[..., ServerHandle],
) -> None:
    with pytest.raises(ConfigError, match="below --threads"):
        create_server(
            ServerConfig(address="127.0.0.1:0", threads=8, max_waiting_calls=8)
        )
    handle = servers()  # the defaults: 128 threads, a quarter of them may wait
    channels = [grpc.insecure_channel(handle.address) for _ in range(8)]
    try:
        with Client(handle.address, timeout=10) as c:
            c.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"w": np.zeros(4)}
            )
            c.create_group(
                "f",
                Adagrad(),
                learning_rate=0.1,
                tensors={"w": np.zeros(4, np.float32)},
            )
            stubs = [pb_grpc.ParameterServerServiceStub(ch) for ch in channels]
            req = pb.PullRequest(group="g", min_version=FOREVER)
            calls = [stubs[i % 8].Pull.future(req) for i in range(64)]  # no deadline
            _until(lambda: handle.store.waiting_calls == 32)
            _until(lambda: sum(_code(f) is not None for f in calls) == 32)
            refused = [f for f in calls if _code(f) is not None]
            assert {_code(f) for f in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert refused[0].exception().details() == (  # type: ignore[union-attr]
                "the server has its limit of 32 calls waiting for a version (of "
                "group 'g' and others); retry later, or pull without min_version"
            )
            _answers_while_held(handle, c, "f")
            for f in calls:
                f.cancel()  # type: ignore[no-untyped-call]
            _until(lambda: handle.store.waiting_calls == 0)
    finally:
        for ch in channels:
            ch.close()


def test_waiting_pulls_end_when_their_callers_leave(
    servers: Callable[..., ServerHandle],
) -> None:
    threads = 8  # every thread but one may wait (no stream limit, no reserve)
    handle = servers(
        threads=threads, max_waiting_calls=threads - 1, max_concurrent_streams=0
    )
    with Client(handle.address, timeout=10) as c:
        c.create_group(
            "f",
            Adagrad(),
            learning_rate=0.1,
            tensors={"w": np.zeros(4, np.float32)},
        )
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            req = pb.PullRequest(group="f", min_version=FOREVER)
            calls = [stub.Pull.future(req) for _ in range(64)]  # no deadline
            _until(lambda: handle.store.waiting_calls == threads - 1)
            _until(lambda: sum(_code(f) is not None for f in calls) == 57)
            _answers_while_held(handle, c, "f")
            for f in calls:
                f.cancel()  # type: ignore[no-untyped-call]
        # The channel is closed: every wait ends within about a second.
        _until(lambda: handle.store.waiting_calls == 0)

        # The whole pool is free again: threads - 1 new waits and a push at once.
        t = c.describe_group("f").update_count
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            again = pb.PullRequest(group="f", min_version=t + 1)
            waits = [stub.Pull.future(again) for _ in range(threads - 1)]
            _until(lambda: handle.store.waiting_calls == threads - 1)
            assert c.push("f", np.ones(4, np.float32), timeout=5) == t + 1
            assert [f.result(timeout=5).update_count for f in waits] == [t + 1] * 7


def test_a_pull_waits_until_its_own_deadline(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(threads=4)
    with Client(handle.address, timeout=10) as c:
        c.create_group(
            "f",
            Adagrad(),
            learning_rate=0.1,
            tensors={"w": np.zeros(4, np.float32)},
        )
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            req = pb.PullRequest(group="f", min_version=FOREVER)
            with pytest.raises(grpc.RpcError) as err:
                stub.Pull(req, timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _until(lambda: handle.store.waiting_calls == 0)


def test_sync_pushes_waiting_for_their_step_end_when_their_callers_leave(
    servers: Callable[..., ServerHandle],
) -> None:
    threads = 8  # every thread but one may wait (no stream limit, no reserve)
    handle = servers(
        threads=threads, max_waiting_calls=threads - 1, max_concurrent_streams=0
    )
    with Client(handle.address, timeout=10) as c:
        c.create_group(
            "s",
            Adagrad(),
            learning_rate=0.1,
            tensors={"w": np.zeros(4, np.float32)},
            consistency=Sync(workers=1000),
        )
        c.create_group(
            "f",
            Adagrad(),
            learning_rate=0.1,
            tensors={"w": np.zeros(4, np.float32)},
        )
        grad = pb.Tensor(
            dtype=pb.DATA_TYPE_FLOAT,
            dims=[4],
            raw_data=np.ones(4, np.float32).tobytes(),
        )
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            calls = [
                stub.Push.future(
                    pb.PushRequest(
                        group="s",
                        gradients=[grad],
                        client_id=f"worker-{i}",
                        seq=1,
                        return_values=True,
                    )
                )
                for i in range(64)
            ]
            _until(lambda: handle.store.waiting_calls == threads - 1)
            _until(lambda: sum(_code(f) is not None for f in calls) == 57)
            refused = {_code(f) for f in calls if _code(f) is not None}
            assert refused == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            # A refused push changed nothing: only the waiting ones are buffered.
            assert c.describe_group("s").pending_contributions == threads - 1
            _answers_while_held(handle, c, "f")
            for f in calls:
                f.cancel()  # type: ignore[no-untyped-call]
        _until(lambda: handle.store.waiting_calls == 0)
        _answers_while_held(handle, c, "f")


# -- slow pullers -------------------------------------------------------------------
def _header_only(
    stub: pb_grpc.ParameterServerServiceStub, group: str
) -> Iterator[pb.PullStreamResponse]:
    it = stub.PullStream(pb.PullStreamRequest(group=group, with_state=True), timeout=30)
    first = next(it)  # type: ignore[call-overload]
    assert first.WhichOneof("part") == "header"
    return it  # type: ignore[return-value]


def _rest(it: Iterator[pb.PullStreamResponse], n: int) -> np.ndarray:
    data = b"".join(m.chunk.data for m in it if m.chunk.index == 0)
    return np.frombuffer(data, np.float32)[:n]


def test_pull_replies_count_against_the_in_flight_bytes(
    servers: Callable[..., ServerHandle],
) -> None:
    n = 2 * MIB  # X and H: 16 MiB of reply per pull with state, more than a window
    reply = 2 * 4 * n
    handle = servers(max_inflight_bytes=3 * reply + 4096)
    with (
        Client(handle.address, timeout=10) as c,
        grpc.insecure_channel(handle.address) as ch,
    ):
        w = np.zeros(n, np.float32)
        c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"w": w})
        stub = pb_grpc.ParameterServerServiceStub(ch)
        readers = [_header_only(stub, "big") for _ in range(3)]
        with pytest.raises(grpc.RpcError) as err:
            _header_only(stub, "big")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert re.fullmatch(
            rf"this pull's reply carries {reply} bytes and only \d+ of the "
            rf"server's {3 * reply + 4096} in-flight bytes are free; retry later",
            err.value.details() or "",
        )
        readers.pop().cancel()  # type: ignore[attr-defined]
        # Released when the stream is cancelled; then a whole pull goes through.
        _until(lambda: _pulls(stub))
        # A stream read to its end releases its bytes too.
        assert np.array_equal(_rest(readers.pop(), n), w)
        assert np.array_equal(_rest(_header_only(stub, "big"), n), w)
        for r in readers:
            r.cancel()  # type: ignore[attr-defined]


def _pulls(stub: pb_grpc.ParameterServerServiceStub) -> bool:
    try:
        _rest(_header_only(stub, "big"), 1)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False
    return True


def test_a_slow_puller_reads_one_version_while_pushes_go_on(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers()
    with (
        Client(handle.address, timeout=10) as c,
        grpc.insecure_channel(handle.address) as ch,
    ):
        n = 600_000  # a few chunks
        c.create_group(
            "big",
            Adagrad(),
            learning_rate=0.1,
            tensors={"w": np.zeros(n, np.float32)},
        )
        stub = pb_grpc.ParameterServerServiceStub(ch)
        early = [_header_only(stub, "big") for _ in range(2)]
        for _ in range(3):
            c.push("big", np.ones(n, np.float32))
        late = _header_only(stub, "big")
        now = c.pull("big")[0]
        assert not np.array_equal(now, np.zeros(n, np.float32))
        for it in early:
            assert np.array_equal(_rest(it, n), np.zeros(n, np.float32))
        assert np.array_equal(_rest(late, n), now)


# -- memory of a real server process -------------------------------------------------
def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_slow_pullers_share_one_copy(
    server_processes: StartServer, tmp_path: Path
) -> None:
    proc, address = server_processes(tmp_path / "server.log")
    size = 32 * MIB  # X; with H a pull carries 64 MiB
    with Client(address, timeout=60) as c:
        w = np.ones(size // 4, np.float32)
        c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"w": w})
    del w
    before = _rss_mib(proc.pid)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        readers = [_header_only(stub, "big") for _ in range(12)]
        time.sleep(0.5)
        grown = _rss_mib(proc.pid) - before
        for r in readers:
            r.cancel()  # type: ignore[attr-defined]
    # One copy of X and H (64 MiB), not twelve (768 MiB).
    assert grown < 3 * 64, f"the server grew by {grown:.0f} MiB"


def _cut_off_push(stub: pb_grpc.ParameterServerServiceStub, g: np.ndarray) -> None:
    """A push whose client runs out of time just before its last chunk."""
    stall = threading.Event()

    def messages() -> Iterator[pb.PushStreamRequest]:
        header = pb.PushRequest(group="big", gradients=[header_tensor(g, "w")])
        yield pb.PushStreamRequest(header=header)
        chunks = list(iter_chunks([g], MIB))
        for chunk in chunks[:-1]:
            yield pb.PushStreamRequest(chunk=chunk)
        stall.wait(30)

    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.PushStream(messages(), timeout=2.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        stall.set()


@pytest.mark.slow
def test_cut_off_pushes_are_released_at_once_and_not_logged_as_bugs(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    # (NumPy kernels: numba's, loaded in the background at start, would grow the
    # server meanwhile by about 100 MiB of their own)
    env = clean_env(ONNXPS_KERNELS="numpy")
    proc, address = server_processes(log, "--log-level", "INFO", env=env)
    size = 32 * MIB
    with Client(address, timeout=60) as c:
        w = np.zeros(size // 4, np.float32)
        c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"w": w})
    before = _rss_mib(proc.pid)
    g = np.full(size // 4, 0.5, np.float32)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        for _ in range(8):
            _cut_off_push(stub, g)
        time.sleep(0.5)
        grown = _rss_mib(proc.pid) - before
        with Client(address, timeout=60) as c:
            assert c.describe_group("big").update_count == 0
    # Eight half-received 32 MiB pushes (256 MiB) do not stay in memory.
    assert grown < 3 * 32, f"the server grew by {grown:.0f} MiB"
    text = log.read_text()
    assert re.findall(r" (ERROR|CRITICAL) |Traceback|INTERNAL", text) == []
    assert len(re.findall(r"rpc PushStream group=big code=CANCELLED", text)) >= 6


def test_cancel_notifies_the_condition_a_wait_watches() -> None:
    """Woken by the cancellation itself, not by the wait's periodic poll: the wait
    on the watched condition returns notified (True), long before its timeout."""
    gone = Cancellation()
    cond = threading.Condition()
    woken: list[bool] = []
    returned = threading.Event()

    def wait() -> None:
        with gone.watching(cond), cond:
            woken.append(cond.wait(timeout=60))
        returned.set()

    t = threading.Thread(target=wait)
    t.start()
    # cancel() gives up on a busy lock (the wait polls then): until the waiter
    # sleeps in cond.wait, a cancel may not reach it, so cancel until it wakes.
    for _ in range(1000):
        gone.cancel()
        if returned.wait(0.05):
            break
    t.join(60)
    assert woken == [True]
    assert gone.cancelled


def test_a_cancellation_wakes_a_waiting_store_call() -> None:
    store = ParameterStore()
    w = np.zeros(4, np.float32)
    store.create_group("g", make_attrs("Adagrad", {}), 0.1, [("w", w)])
    gone = Cancellation()
    ended: list[BaseException] = []

    def pull() -> None:
        try:
            store.pull("g", min_version=FOREVER, cancellation=gone)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            ended.append(exc)

    t = threading.Thread(target=pull)
    t.start()
    _until(lambda: store.waiting_calls == 1)
    gone.cancel()
    t.join(30)
    assert not t.is_alive()
    assert [type(e) for e in ended] == [CallCancelled]
    assert str(ended[0]) == f"the caller waiting for T={FOREVER} of group 'g' went away"
    assert store.waiting_calls == 0
    store.close()


def test_at_the_waiting_limit_only_a_sync_push_that_would_wait_is_refused(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(threads=8, max_waiting_calls=3)
    grad = np.ones(4, np.float32)
    with Client(handle.address, timeout=10) as c:
        c.create_group(
            "s",
            Adagrad(),
            learning_rate=0.1,
            tensors={"w": np.zeros(4, np.float32)},
            consistency=Sync(workers=5),
        )
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)

            def push(worker: str, return_values: bool) -> grpc.Future[Any]:
                return stub.Push.future(
                    pb.PushRequest(
                        group="s",
                        gradients=[
                            pb.Tensor(
                                dtype=pb.DATA_TYPE_FLOAT,
                                dims=[4],
                                raw_data=grad.tobytes(),
                            )
                        ],
                        client_id=worker,
                        seq=1,
                        return_values=return_values,
                    ),
                    timeout=10,
                )

            waiting = [push(f"w{i}", True) for i in range(3)]
            _until(lambda: handle.store.waiting_calls == 3)
            with pytest.raises(grpc.RpcError) as err:
                push("w3", True).result()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.describe_group("s").pending_contributions == 3  # unchanged
            assert push("w3", False).result().applied is False
            # The push that completes the step needs no slot: it goes through.
            last = push("w4", True).result()
            assert (last.applied, last.update_count) == (True, 1)
            values = [np.frombuffer(last.values[0].raw_data, np.float32)]
            for f in waiting:
                reply = f.result()
                values.append(np.frombuffer(reply.values[0].raw_data, np.float32))
            assert all(np.array_equal(v, values[0]) for v in values)
            assert not np.array_equal(values[0], np.zeros(4, np.float32))
        assert handle.store.waiting_calls == 0
