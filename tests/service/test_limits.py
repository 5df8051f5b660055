"""Limits refuse work with RESOURCE_EXHAUSTED instead of queueing or allocating it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from deadlines import waited_for
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.client import (
    Adagrad,
    Client,
    DeadlineExceededError,
    ResourceExhaustedError,
)
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _until(probe: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not probe():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def test_store_limits_on_group_size_total_bytes_and_count(
    servers: Callable[..., ServerHandle],
) -> None:
    w = np.zeros(64, np.float32)  # 256 bytes; Adagrad keeps H too: 512 per group
    handle = servers(max_group_bytes=600, max_total_bytes=1200, max_groups=3)
    with Client(handle.address, timeout=10) as c:
        for transport in ("unary", "stream"):
            c.transport = transport
            with pytest.raises(ResourceExhaustedError) as err:
                c.create_group(
                    "big", Adagrad(), learning_rate=1.0, tensors={"w": np.zeros(80)}
                )
            assert err.value.details == (
                "a group of 1280 bytes (X with its V/H) is over the server's "
                "limit of 600 bytes per group"
            )
        c.transport = "auto"
        c.create_group("g1", Adagrad(), learning_rate=1.0, tensors={"w": w})
        c.create_group("g2", Adagrad(), learning_rate=1.0, tensors={"w": w})
        with pytest.raises(ResourceExhaustedError) as err:
            c.create_group("g3", Adagrad(), learning_rate=1.0, tensors={"w": w})
        assert err.value.details == (
            "group 'g3' needs 512 bytes; the server would hold 1536, over its "
            "limit of 1200"
        )
        small = np.zeros(8, np.float32)
        c.create_group("g3", Adagrad(), learning_rate=1.0, tensors={"w": small})
        with pytest.raises(ResourceExhaustedError) as err:
            c.create_group("g4", Adagrad(), learning_rate=1.0, tensors={"w": small})
        assert err.value.details == "the server holds its limit of 3 groups"
        assert sorted(g.name for g in c.list_groups()) == ["g1", "g2", "g3"]


def test_in_flight_bytes_are_bounded_and_released(
    servers: Callable[..., ServerHandle],
) -> None:
    limit = 1 << 20
    n = 150_000  # 600,000 bytes of float32: one fits in flight, two do not
    handle = servers(max_inflight_bytes=limit)
    release = threading.Event()
    header_sent = threading.Event()
    stream_result: list[object] = []
    try:
        with (
            grpc.insecure_channel(handle.address) as ch,
            Client(handle.address, timeout=10, transport="unary") as c,
        ):
            stub = pb_grpc.ParameterServerServiceStub(ch)
            w = np.zeros(n, np.float32)
            c.create_group("big", Adagrad(), learning_rate=1.0, tensors={"w": w})
            grad = np.ones(n, np.float32)
            assert c.push("big", grad) == 1

            # One call larger than the whole budget is refused at once, unallocated.
            huge = pb.ApplyStreamRequest(
                request=pb.ApplyRequest(
                    optimizer=Adagrad().to_proto(),
                    inputs=[pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[2**40])],
                )
            )
            with pytest.raises(grpc.RpcError) as err:
                list(stub.ApplyStream(iter([huge]), timeout=10))
            assert err.value.code() == RESOURCE_EXHAUSTED
            assert err.value.details() == (
                f"this call carries {4 * 2**40 + 256} bytes, over the "
                f"server's limit of {limit} bytes in flight; send smaller pieces"
            )

            # A stream that sent its header holds its declared bytes until it ends.
            header = pb.PushStreamRequest(
                header=pb.PushRequest(
                    group="big",
                    gradients=[pb.Tensor(name="w", dtype=pb.DATA_TYPE_FLOAT, dims=[n])],
                )
            )

            def slow_stream() -> Iterator[pb.PushStreamRequest]:
                yield header
                header_sent.set()
                release.wait(10)
                data = grad.tobytes()
                yield pb.PushStreamRequest(
                    chunk=pb.TensorChunk(index=0, offset=0, data=data)
                )

            def run_stream() -> None:
                try:
                    stream_result.append(stub.PushStream(slow_stream(), timeout=20))
                except grpc.RpcError as exc:
                    stream_result.append(exc.code())

            t = threading.Thread(target=run_stream)
            t.start()
            assert header_sent.wait(10)
            probe = pb.ListGroupsRequest(prefix="p" * 600_000)  # stateless, 600 KB

            def probe_refused() -> bool:
                try:
                    stub.ListGroups(probe, timeout=10)
                except grpc.RpcError as exc:
                    assert exc.code() == RESOURCE_EXHAUSTED
                    assert "in-flight bytes are free; retry later" in (
                        exc.details() or ""
                    )
                    return True
                return False

            _until(probe_refused)
            with pytest.raises(ResourceExhaustedError) as exhausted:
                c.push("big", grad)
            assert exhausted.value.reason == "INFLIGHT_BYTES"
            assert exhausted.value.metadata["limit"] == str(limit)
            assert c.describe_group("big").update_count == 1
            release.set()
            t.join(20)
            assert len(stream_result) == 1
            reply = stream_result[0]
            assert isinstance(reply, pb.PushStreamResponse) and reply.update_count == 2
            # released: the same calls go through now
            assert stub.ListGroups(probe, timeout=10).groups == []
            assert c.push("big", grad) == 3
    finally:
        release.set()


def test_concurrent_streams_are_bounded(servers: Callable[..., ServerHandle]) -> None:
    handle = servers(max_concurrent_streams=1)
    got: list[object] = []
    with (
        grpc.insecure_channel(handle.address) as ch,
        Client(handle.address, timeout=10) as c,
    ):
        stub = pb_grpc.ParameterServerServiceStub(ch)
        w = np.zeros(4, np.float32)
        c.create_group("g", Adagrad(), learning_rate=1.0, tensors={"w": w})
        waiting = pb.PullStreamRequest(group="g", min_version=1)

        def wait_pull() -> None:
            # The probe below may take the one slot first: retry until admitted.
            deadline = time.monotonic() + 20
            while True:
                try:
                    got.append(list(stub.PullStream(waiting, timeout=20)))
                    return
                except grpc.RpcError as exc:
                    refused = exc.code() == RESOURCE_EXHAUSTED
                    if not refused or time.monotonic() > deadline:
                        got.append(exc)
                        return
                time.sleep(0.01)

        t = threading.Thread(target=wait_pull)
        t.start()

        def second_refused() -> bool:
            try:
                list(stub.PullStream(pb.PullStreamRequest(group="g"), timeout=10))
            except grpc.RpcError as exc:
                assert exc.code() == RESOURCE_EXHAUSTED
                assert exc.details() == (
                    "the server is at its limit of 1 concurrent streams; retry later"
                )
                return True
            return False

        _until(second_refused)
        assert c.describe_group("g").update_count == 0  # unary calls still run
        assert c.push("g", np.ones(4, np.float32)) == 1  # wakes the waiter
        t.join(20)
        assert len(got) == 1
        chunks = got[0]
        assert isinstance(chunks, list)
        assert chunks[0].header.update_count == 1
        # the slot is free again
        again = list(stub.PullStream(pb.PullStreamRequest(group="g"), timeout=10))
        assert again[0].header.update_count == 1


def test_streams_count_from_when_they_open_not_from_their_header(
    servers: Callable[..., ServerHandle],
) -> None:
    """ISSUE11 item 2: a stream that has sent nothing holds a slot all the same."""
    handle = servers(max_concurrent_streams=4, threads=32)
    stop = threading.Event()

    def silent() -> Iterator[pb.PushStreamRequest]:
        stop.wait(30)
        yield from ()

    try:
        with (
            grpc.insecure_channel(handle.address) as ch,
            Client(handle.address, timeout=10, transport="stream") as c,
        ):
            w = np.zeros(4, np.float32)
            c.create_group("g", Adagrad(), learning_rate=1.0, tensors={"w": w})
            stub = pb_grpc.ParameterServerServiceStub(ch)
            held = [stub.PushStream.future(silent(), timeout=30) for _ in range(4)]
            # Probe only once the server runs all four: a probe admitted before one of
            # them would take its slot, and that one would be refused instead.
            _until(lambda: handle.gate.running == 4)

            def fifth_refused() -> bool:
                try:
                    stub.PushStream(silent(), timeout=0.5)
                except grpc.RpcError as exc:
                    if exc.code() != RESOURCE_EXHAUSTED:
                        return False
                    assert exc.details() == (
                        "the server is at its limit of 4 concurrent streams; retry "
                        "later"
                    )
                    return True
                return False

            _until(fifth_refused)
            assert not any(f.done() for f in held)
            assert c.describe_group("g").update_count == 0  # unary calls still run
            stop.set()
            for f in held:
                exc = f.exception(timeout=10)  # type: ignore[call-arg]
                assert isinstance(exc, grpc.RpcError)
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert c.push("g", np.ones(4, np.float32)) == 1  # the slots are free
    finally:
        stop.set()


def test_a_client_deadline_ends_a_waiting_pull(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers()
    with Client(handle.address, timeout=10) as c:
        w = np.zeros(4, np.float32)
        c.create_group("g", Adagrad(), learning_rate=1.0, tensors={"w": w})
        with pytest.raises(DeadlineExceededError) as info:
            c.pull("g", min_version=5, timeout=0.3)
        assert waited_for(info.value.details) == 0.3  # not the client's 10 s


def test_interceptor_refusals_carry_error_info_and_the_request_id(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(max_concurrent_streams=1)
    with grpc.insecure_channel(handle.address) as ch:
        raw = ch.unary_unary(
            "/onnxps.v1.ParameterServerService/Push",
            request_serializer=None,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff", metadata=(("x-request-id", "req-7"),), timeout=10)
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    (packed,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert packed.Unpack(info)
    assert (info.reason, info.domain) == ("MALFORMED_MESSAGE", "onnxps.v1")
    assert status.message.startswith("the request of Push is not a valid protobuf")
    assert ("x-request-id", "req-7") in err.value.trailing_metadata()  # type: ignore[comparison-overlap]
