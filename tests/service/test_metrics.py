"""The Prometheus endpoint counts what happened; every RPC logs its request id."""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from onnxps.client import Adagrad, Client, InvalidArgumentError, NotFoundError
from onnxps.server.app import ServerHandle
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

W0 = np.array([1.0, 2.0, 3.0], np.float32)
G = np.array([0.5, -0.5, 0.25], np.float32)


def scrape(
    handle: ServerHandle,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_pushes_pulls_applies_and_read_the_store(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(metrics_port=0)
    assert handle.metrics_port is not None and handle.metrics_port > 0
    with Client(handle.address, timeout=10, transport="unary") as c:
        c.create_group("g", Adagrad(), learning_rate=0.5, tensors={"w": W0})
        assert c.push("g", G, base_version=0) == 1
        assert c.push("g", G, base_version=1) == 2
        assert c.push("g", G, base_version=0) == 3  # 2 steps stale
        with pytest.raises(InvalidArgumentError):
            c.push("g", np.ones(4, np.float32))
        with pytest.raises(NotFoundError):
            c.push("missing", G)
        c.pull("g")
        c.pull("g", state=True)
        with pytest.raises(NotFoundError):
            c.pull("made-up-name")
        c.apply(Adagrad(), np.float32(0.1), np.int64(0), W0, G, np.zeros(3, np.float32))
        c.join("g", worker_id="w1")
        m = scrape(handle)
        c.leave("g", worker_id="w1")

    def v(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert v("onnxps_pushes_total", group="g", code="OK") == 3
    assert v("onnxps_pushes_total", group="g", code="INVALID_ARGUMENT") == 1
    assert v("onnxps_pushes_total", group="-", code="NOT_FOUND") == 1  # no made-up
    assert v("onnxps_rejected_pushes_total", code="INVALID_ARGUMENT") == 1
    assert v("onnxps_rejected_pushes_total", code="NOT_FOUND") == 1
    assert v("onnxps_pulls_total", group="g", code="OK") == 2
    assert v("onnxps_pulls_total", group="-", code="NOT_FOUND") == 1
    assert v("onnxps_applies_total", code="OK") == 1
    assert v("onnxps_rpcs_total", method="CreateGroup", code="OK") == 1
    assert v("onnxps_rpcs_total", method="JoinGroup", code="OK") == 1
    assert v("onnxps_push_duration_seconds_count") == 5
    assert v("onnxps_apply_duration_seconds_count") == 1
    assert v("onnxps_push_staleness_count") == 3
    assert v("onnxps_push_staleness_sum") == 2
    assert v("onnxps_push_staleness_bucket", le="0.0") == 2
    assert v("onnxps_push_staleness_bucket", le="2.0") == 3
    # bytes: each push carried 12 gradient bytes; a state pull returns 24 (X and H)
    assert v("onnxps_received_bytes_total", method="Push") >= 3 * 12 + 16
    assert v("onnxps_sent_bytes_total", method="Pull") >= 12 + 24
    assert v("onnxps_sent_bytes_total", method="Push") > 0
    # gauges read from the store at scrape time
    assert v("onnxps_groups") == 1
    assert v("onnxps_state_bytes") == 24
    assert v("onnxps_group_state_bytes", group="g") == 24
    assert v("onnxps_group_update_count", group="g") == 3
    assert v("onnxps_live_workers", group="g") == 1
    assert not [k for k in m if ("group", "made-up-name") in k[1]]


def test_two_servers_keep_separate_registries_and_stop_their_endpoints(
    servers: Callable[..., ServerHandle],
) -> None:
    a, b = servers(metrics_port=0), servers(metrics_port=0)
    assert a.metrics_port != b.metrics_port
    with Client(a.address, timeout=10) as c:
        c.create_group("g", Adagrad(), learning_rate=0.5, tensors={"w": W0})
        c.push("g", G)
    ma, mb = scrape(a), scrape(b)
    key = ("onnxps_pushes_total", (("code", "OK"), ("group", "g")))
    assert ma[key] == 1
    assert key not in mb
    assert mb[("onnxps_groups", ())] == 0
    a.stop(grace=0)
    b.stop(grace=0)
    with pytest.raises(urllib.error.URLError):
        scrape(a)


def test_no_metrics_port_serves_no_endpoint(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers()
    assert handle.metrics_port is None


def test_each_rpc_logs_method_group_code_and_its_request_id(
    servers: Callable[..., ServerHandle],
    caplog: pytest.LogCaptureFixture,
) -> None:
    handle = servers()
    with grpc.insecure_channel(handle.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        with caplog.at_level(logging.DEBUG, logger="onnxps.rpc"):
            with pytest.raises(grpc.RpcError) as err:
                stub.Pull(
                    pb.PullRequest(group="nope"),
                    metadata=(("x-request-id", "req-42"),),
                    timeout=10,
                )
            reply, call = stub.ListGroups.with_call(pb.ListGroupsRequest(), timeout=10)
            bad_id = "x" * 65  # too long: replaced with a fresh id
            _, call2 = stub.ListGroups.with_call(
                pb.ListGroupsRequest(), metadata=(("x-request-id", bad_id),)
            )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert ("x-request-id", "req-42") in err.value.trailing_metadata()  # type: ignore[comparison-overlap]
    generated = dict(call.trailing_metadata())["x-request-id"]
    assert len(generated) == 16 and generated != "req-42"
    assert dict(call2.trailing_metadata())["x-request-id"] != bad_id
    records = [r for r in caplog.records if r.name == "onnxps.rpc"]
    failed = [r for r in records if getattr(r, "request_id", None) == "req-42"]
    assert len(failed) == 1
    assert failed[0].levelno == logging.INFO
    msg = failed[0].getMessage()
    assert msg.startswith("rpc Pull group=nope code=NOT_FOUND duration_ms=")
    assert msg.endswith(" request_id=req-42")
    ok = [r for r in records if getattr(r, "request_id", None) == generated]
    assert len(ok) == 1 and ok[0].levelno == logging.DEBUG
    assert ok[0].getMessage().startswith("rpc ListGroups group=- code=OK ")
    assert ok[0].rpc_code == "OK"  # type: ignore[attr-defined]


def test_load_gauges_count_a_waiting_call_while_it_waits(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(metrics_port=0)
    with Client(handle.address, timeout=10) as c:
        c.create_group("g", Adagrad(), learning_rate=0.5, tensors={"w": W0})
        idle = scrape(handle)
        assert idle[("onnxps_calls_in_flight", ())] == 0
        assert idle[("onnxps_waiting_calls", ())] == 0
        assert idle[("onnxps_inflight_bytes", ())] == 0
        got: list[object] = []
        waiter = threading.Thread(
            target=lambda: got.append(c.pull("g", min_version=1, timeout=10))
        )
        waiter.start()
        deadline = time.monotonic() + 10
        m = scrape(handle)
        while m[("onnxps_waiting_calls", ())] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
            m = scrape(handle)
        assert m[("onnxps_waiting_calls", ())] == 1
        assert m[("onnxps_calls_in_flight", ())] == 1
        c.push("g", G)
        waiter.join(10)
        assert len(got) == 1
        after = scrape(handle)
        assert after[("onnxps_waiting_calls", ())] == 0
        assert after[("onnxps_calls_in_flight", ())] == 0
