"""Observability: a request id and a log line per RPC, and Prometheus metrics.

Every RPC gets a request id (the caller's ``x-request-id`` metadata when it sends a
sane one, else a fresh one), returned in the trailing metadata and logged with the
method, group, status code and duration (DEBUG when OK, INFO otherwise).

With ``metrics_port`` set, each server keeps its own ``CollectorRegistry`` (several
servers in one process do not collide) served over HTTP. Counters and histograms are
recorded by the interceptor; gauges (groups, state bytes, live workers, T) are read
from the store when scraped. A ``group`` label is only ever the name of a group that
exists, so callers cannot grow the label set with made-up names.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ._handlers import SERVICE, Behavior, group_of, method_of, peek, rewrap
from .limits import message_bytes, received_bytes
from .security import is_loopback
from .store import ParameterStore

__all__ = ["ObserveInterceptor", "Recorder", "StoreCollector", "attach", "interceptors"]

log = logging.getLogger("onnxps.rpc")

_PUSH = frozenset({"Push", "PushStream"})
_PULL = frozenset({"Pull", "PullStream"})
_APPLY = frozenset({"Apply", "ApplyStream"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024)

# create_server calls interceptors(config) and then attach(handle) on one thread;
# this carries the interceptor's recorder from the first call to the second.
_pending = threading.local()


class Recorder:
    """The metrics of one server (None of them when it serves no metrics)."""

    def __init__(self, enabled: bool) -> None:
        self.store: Any = None
        self.registry: CollectorRegistry | None = None
        if not enabled:
            return
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.rpcs = Counter(
            "onnxps_rpcs",
            "RPCs by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "onnxps_rpc_duration_seconds",
            "RPC latency by method",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pushes = Counter(
            "onnxps_pushes",
            "Pushes by group and status code",
            ["group", "code"],
            registry=r,
        )
        self.pulls = Counter(
            "onnxps_pulls",
            "Pulls by group and status code",
            ["group", "code"],
            registry=r,
        )
        self.applies = Counter(
            "onnxps_applies",
            "Stateless Apply calls by status code",
            ["code"],
            registry=r,
        )
        self.rejected = Counter(
            "onnxps_rejected_pushes",
            "Pushes refused, by status code",
            ["code"],
            registry=r,
        )
        self.bytes_in = Counter(
            "onnxps_received_bytes",
            "Request bytes received, by method",
            ["method"],
            registry=r,
        )
        self.bytes_out = Counter(
            "onnxps_sent_bytes",
            "Response bytes sent, by method",
            ["method"],
            registry=r,
        )
        self.push_seconds = Histogram(
            "onnxps_push_duration_seconds",
            "Push latency (unary and stream)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.apply_seconds = Histogram(
            "onnxps_apply_duration_seconds",
            "Apply latency (unary and stream)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.staleness = Histogram(
            "onnxps_push_staleness",
            "T minus base_version of accepted pushes that carried a base_version",
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )

    def group_label(self, group: str | None) -> str:
        if group is None or self.store is None:
            return "-"
        try:
            self.store.describe(group)
        except Exception:  # noqa: BLE001 - unknown (or deleted) group
            return "-"
        return group

    def record(self, call: _Call, code: str, seconds: float) -> None:
        if self.registry is None:
            return
        m = call.method
        self.rpcs.labels(m, code).inc()
        self.rpc_seconds.labels(m).observe(seconds)
        self.bytes_in.labels(m).inc(call.bytes_in)
        self.bytes_out.labels(m).inc(call.bytes_out)
        if m in _PUSH:
            self.pushes.labels(self.group_label(call.group), code).inc()
            self.push_seconds.observe(seconds)
            if code != "OK":
                self.rejected.labels(code).inc()
            else:
                self._staleness(call)
        elif m in _PULL:
            self.pulls.labels(self.group_label(call.group), code).inc()
        elif m in _APPLY:
            self.applies.labels(code).inc()
            self.apply_seconds.observe(seconds)

    def _staleness(self, call: _Call) -> None:
        req, reply = call.first, call.reply
        if req is not None and "part" in req.DESCRIPTOR.oneofs_by_name:
            req = req.header if req.WhichOneof("part") == "header" else None
        if req is None or reply is None or not req.HasField("base_version"):
            return
        if reply.duplicate:
            return
        t_before = reply.update_count - 1 if reply.applied else reply.update_count
        self.staleness.observe(max(0, t_before - req.base_version))


class StoreCollector(Collector):
    """Gauges read from the store at scrape time."""

    def __init__(self, store: ParameterStore) -> None:
        self.store = store

    def collect(self) -> Iterable[Any]:
        groups = self.store.groups()
        yield GaugeMetricFamily("onnxps_groups", "Groups held", value=len(groups))
        total = GaugeMetricFamily("onnxps_state_bytes", "Bytes of X, V, H held")
        per = GaugeMetricFamily(
            "onnxps_group_state_bytes", "Bytes of X, V, H per group", labels=["group"]
        )
        workers = GaugeMetricFamily(
            "onnxps_live_workers", "Workers holding a live lease", labels=["group"]
        )
        version = GaugeMetricFamily(
            "onnxps_group_update_count", "T, the steps applied", labels=["group"]
        )
        held = 0
        for view in groups:
            held += view.state_bytes
            per.add_metric([view.name], view.state_bytes)
            workers.add_metric([view.name], len(view.workers))
            version.add_metric([view.name], view.update_count)
        total.add_metric([], held)
        yield from (total, per, workers, version)

    def describe(self) -> Iterable[Any]:
        return []


@dataclass
class _Call:
    method: str
    request_id: str
    group: str | None = None
    first: Any = None  # the unary request, or a stream's first message
    reply: Any = None  # the unary reply
    bytes_in: int = 0
    bytes_out: int = 0
    failed: bool = False


def _size(msg: Any) -> int:
    return message_bytes(msg)


def request_id(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "x-request-id":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            if _REQUEST_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex[:16]


class ObserveInterceptor(grpc.ServerInterceptor):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, method = method_of(handler_call_details)
        name = method if service == SERVICE else f"{service}/{method}"
        rid = request_id(handler_call_details.invocation_metadata)
        return rewrap(handler, lambda b, rs, ss: self._make(b, rs, ss, name, rid))

    def _begin(
        self, call: _Call, request: Any, context: grpc.ServicerContext, req_s: bool
    ) -> Any:
        context.set_trailing_metadata((("x-request-id", call.request_id),))
        if not req_s:
            call.first, call.group, call.bytes_in = (
                request,
                group_of(request),
                received_bytes(request),
            )
            return request
        call.first, request = peek(request)
        call.group = group_of(call.first)
        return self._count_in(request, call)

    @staticmethod
    def _count_in(it: Iterator[Any], call: _Call) -> Iterator[Any]:
        for msg in it:
            call.bytes_in += received_bytes(msg, forget=True)
            yield msg

    def _end(self, call: _Call, context: grpc.ServicerContext, start: float) -> None:
        seconds = time.perf_counter() - start
        code = context.code()
        if code is None:
            if not call.failed:
                code = grpc.StatusCode.OK
            elif not context.is_active():
                code = grpc.StatusCode.CANCELLED
            else:
                code = grpc.StatusCode.UNKNOWN
        name = code.name
        level = logging.DEBUG if name == "OK" else logging.INFO
        if log.isEnabledFor(level):
            log.log(
                level,
                "rpc %s group=%s code=%s duration_ms=%.2f bytes_in=%d bytes_out=%d "
                "request_id=%s",
                call.method,
                call.group if call.group is not None else "-",
                name,
                seconds * 1e3,
                call.bytes_in,
                call.bytes_out,
                call.request_id,
                extra={
                    "request_id": call.request_id,
                    "rpc_method": call.method,
                    "rpc_group": call.group,
                    "rpc_code": name,
                    "duration_ms": seconds * 1e3,
                },
            )
        try:
            self.recorder.record(call, name, seconds)
        except Exception:  # noqa: BLE001 - metrics must never fail a call
            log.exception("recording metrics for %s failed", call.method)

    def _make(
        self, behavior: Behavior, req_s: bool, resp_s: bool, method: str, rid: str
    ) -> Behavior:
        if resp_s:

            def call_streaming(request: Any, context: grpc.ServicerContext) -> Any:
                call, start = _Call(method, rid), time.perf_counter()
                try:
                    request = self._begin(call, request, context, req_s)
                    for msg in behavior(request, context):
                        call.bytes_out += _size(msg)
                        yield msg
                except BaseException:
                    call.failed = True
                    raise
                finally:
                    self._end(call, context, start)

            return call_streaming

        def call_unary(request: Any, context: grpc.ServicerContext) -> Any:
            call, start = _Call(method, rid), time.perf_counter()
            try:
                request = self._begin(call, request, context, req_s)
                call.reply = behavior(request, context)
                call.bytes_out = _size(call.reply)
                return call.reply
            except BaseException:
                call.failed = True
                raise
            finally:
                self._end(call, context, start)

        return call_unary


def interceptors(config: Any) -> list[grpc.ServerInterceptor]:
    recorder = Recorder(enabled=config.metrics_port is not None)
    _pending.recorder = recorder
    return [ObserveInterceptor(recorder)]


def _metrics_host(address: str) -> str:
    if not is_loopback(address):
        host = address.rsplit(":", 1)[0]
        return host.strip("[]")
    host = address.rsplit(":", 1)[0].strip("[]")
    return "::1" if host == "::1" else "127.0.0.1"


def attach(handle: Any) -> None:
    """Give the recorder its store; serve the metrics endpoint if configured."""
    recorder: Recorder | None = getattr(_pending, "recorder", None)
    _pending.recorder = None
    if recorder is None:
        return
    recorder.store = handle.store
    port = handle.config.metrics_port
    if port is None or recorder.registry is None:
        return
    recorder.registry.register(StoreCollector(handle.store))
    httpd, thread = start_http_server(
        port, addr=_metrics_host(handle.config.address), registry=recorder.registry
    )
    handle.metrics_port = httpd.server_port
    log.info(
        "metrics on http://%s:%d/metrics", httpd.server_address[0], httpd.server_port
    )

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    handle.on_stop.append(stop)
