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
import random
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .durability._wal import FsyncTimes
from .interceptors._handlers import (
    SERVICE,
    Call,
    CallHooks,
    Handler,
    HookInterceptor,
    group_of,
    on_first,
)
from .interceptors.limits import message_bytes
from .interceptors.security import is_loopback
from .store import ParameterStore

__all__ = [
    "DurabilityCollector",
    "MetricsEndpoint",
    "ObserveInterceptor",
    "Recorder",
    "StoreCollector",
]

log = logging.getLogger("onnxps.rpc")

_PUSH = frozenset({"Push", "PushStream", "PushPullStream", "PushRows"})
_PULL = frozenset({"Pull", "PullStream", "PullRows", "ListRows"})
_APPLY = frozenset({"Apply", "ApplyStream"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
_random_bits = random.getrandbits
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


class Recorder:
    """The metrics of one server (None of them when it serves no metrics)."""

    def __init__(self, store: Any, enabled: bool) -> None:
        self.store = store
        self.registry: CollectorRegistry | None = None
        if not enabled:
            return
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(StoreCollector(store))
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
        self.errors = Counter(
            "onnxps_errors",
            "Calls that ended with an error, by method, status code and the "
            "ErrorInfo reason (ERROR when the status carries none)",
            ["method", "code", "reason"],
            registry=r,
        )
        self.group_push_seconds = Histogram(
            "onnxps_group_push_duration_seconds",
            "Push latency by group (unary, stream and rows)",
            ["group"],
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
        if group is None:
            return "-"
        try:
            self.store.describe(group)
        except Exception:  # noqa: BLE001 - unknown (or deleted) group
            return "-"
        return group

    def record(
        self,
        m: str,
        call: Call,
        group_named: str | None,
        code: str,
        seconds: float,
        reason: str | None = None,
    ) -> None:
        """One call of method ``m`` (``group_named``: the group its request
        names) that ended with ``code`` after ``seconds``."""
        if self.registry is None:
            return
        self.rpcs.labels(m, code).inc()
        self.rpc_seconds.labels(m).observe(seconds)
        self.bytes_in.labels(m).inc(call.size)
        self.bytes_out.labels(m).inc(call.bytes_out)
        if code != "OK":
            self.errors.labels(m, code, reason or "ERROR").inc()
        if m in _PUSH:
            group = self.group_label(group_named)
            self.pushes.labels(group, code).inc()
            self.push_seconds.observe(seconds)
            self.group_push_seconds.labels(group).observe(seconds)
            if code != "OK":
                self.rejected.labels(code).inc()
            else:
                self._staleness(call)
        elif m in _PULL:
            self.pulls.labels(self.group_label(group_named), code).inc()
        elif m in _APPLY:
            self.applies.labels(code).inc()
            self.apply_seconds.observe(seconds)

    def _staleness(self, call: Call) -> None:
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


class LoadCollector(Collector):
    """Gauges of the load right now: calls running, bytes held, calls waiting."""

    def __init__(
        self,
        calls: Callable[[], int],
        inflight_bytes: Callable[[], int],
        waiting: Callable[[], int],
        pooled: Callable[[], int] = lambda: 0,
    ) -> None:
        self.calls, self.inflight_bytes, self.waiting = calls, inflight_bytes, waiting
        self.pooled = pooled

    def collect(self) -> Iterable[Any]:
        yield GaugeMetricFamily(
            "onnxps_calls_in_flight",
            "Service calls admitted and not yet finished",
            value=self.calls(),
        )
        yield GaugeMetricFamily(
            "onnxps_inflight_bytes",
            "Request and reply bytes held, counted against --max-inflight-bytes",
            value=self.inflight_bytes(),
        )
        yield GaugeMetricFamily(
            "onnxps_waiting_calls",
            "Calls waiting for a version (pull min_version, sync push), "
            "bounded by --max-waiting-calls",
            value=self.waiting(),
        )
        yield GaugeMetricFamily(
            "onnxps_gradient_pool_bytes",
            "Idle gradient buffers kept for the next push, bounded by "
            "--gradient-pool-bytes",
            value=self.pooled(),
        )

    def describe(self) -> Iterable[Any]:
        return []


class DurabilityCollector(Collector):
    """A gauge per reason the data directory does not keep changes now (1: it is
    so; health is NOT_SERVING meanwhile)."""

    REASONS = ("DISK_FULL", "WAL_UNLINKED", "WAL_WRITE_FAILED", "SNAPSHOT_FAILED")

    def __init__(
        self,
        alarms: Callable[[], set[str]],
        fsyncs: Callable[[], FsyncTimes | None] = lambda: None,
        retained: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self.alarms = alarms
        self.fsyncs = fsyncs
        self.retained = retained

    def collect(self) -> Iterable[Any]:
        times = self.fsyncs()
        if times is not None:
            buckets, total = times.buckets()
            yield HistogramMetricFamily(
                "onnxps_wal_fsync_duration_seconds",
                "How long each fsync of the write-ahead log took (one per batch of "
                "records: group commit)",
                buckets=[
                    (repr(le) if le != float("inf") else "+Inf", n) for le, n in buckets
                ],
                sum_value=total,
            )
        now = self.alarms()
        alarm = GaugeMetricFamily(
            "onnxps_durability_alarm",
            "1 while the data directory cannot keep changes for this reason "
            "(DISK_FULL, WAL_UNLINKED, WAL_WRITE_FAILED: changes are refused; "
            "SNAPSHOT_FAILED: serving from memory)",
            labels=["reason"],
        )
        for reason in self.REASONS:
            alarm.add_metric([reason], 1 if reason in now else 0)
        yield alarm
        if self.retained is not None:
            snapshots, wal = self.retained()
            held = GaugeMetricFamily(
                "onnxps_retained_bytes",
                "Bytes the data directory holds for retention: the kept snapshots "
                "and the write-ahead log since the oldest of them (how far back "
                "groups can be rewound or forked)",
                labels=["kind"],
            )
            held.add_metric(["snapshots"], snapshots)
            held.add_metric(["wal"], wal)
            yield held

    def describe(self) -> Iterable[Any]:
        return []


def request_id(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "x-request-id":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            if _REQUEST_ID.fullmatch(text):
                return text
            break
    # 16 hex digits (a label for logs, not a secret: no system call for it)
    return f"{_random_bits(64):016x}"


class ObserveInterceptor(HookInterceptor):
    """The outermost interceptor: sees every call, refused ones too. It reads
    nothing from a call itself, so a caller that never sends is refused further in
    (authentication, stream limit) without waiting here."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def method_hooks(
        self, handler: Handler, called: tuple[str, str]
    ) -> CallHooks | None:
        service, method = called
        label = method if service == SERVICE else f"{service}/{method}"
        kind = _ObservedStream if handler.response_streaming else _Observed
        return kind(self.recorder, label, bool(handler.request_streaming))


# grpc.StatusCode's names, read without the enum's descriptor on every call.
_CODE_NAMES = {code: code.name for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK


class _Observed(CallHooks):
    """The calls of one method as logged and recorded: each one's id, duration,
    sizes, group, first request and reply (kept in its ``Call``).

    A call's group and a unary reply's size are read only when the call is logged
    or recorded."""

    __slots__ = ("method", "recorder", "req_s")
    resp_s = False  # a unary reply's bytes are counted at the end

    def __init__(self, recorder: Recorder, method: str, req_s: bool) -> None:
        self.recorder = recorder
        self.method = method
        self.req_s = req_s

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        call.start = time.perf_counter()
        call.request_id = rid = request_id(call.metadata)
        context.set_trailing_metadata((("x-request-id", rid),))
        if self.req_s:
            # its group is read only when the call is logged or recorded
            return on_first(request, call.see_first)
        call.first = request
        return request

    def finish(self, call: Call, context: grpc.ServicerContext, failed: bool) -> None:
        seconds = time.perf_counter() - call.start
        code = context.code()  # type: ignore[attr-defined]
        if code is None:
            if not failed:
                code = grpc.StatusCode.OK
            elif not context.is_active():
                code = grpc.StatusCode.CANCELLED
            else:
                code = grpc.StatusCode.UNKNOWN
        # (an enum's hash is a Python call: OK, most calls' code, is looked at first)
        name = "OK" if code is _OK else _CODE_NAMES.get(code) or code.name
        level = logging.DEBUG if name == "OK" else logging.INFO
        logged = log.isEnabledFor(level)
        if not logged and self.recorder.registry is None:
            return
        group = group_of(call.first)
        if not self.resp_s and call.reply is not None:
            call.bytes_out = message_bytes(call.reply)
        if logged:
            log.log(
                level,
                "rpc %s group=%s code=%s duration_ms=%.2f bytes_in=%d bytes_out=%d "
                "request_id=%s",
                self.method,
                group if group is not None else "-",
                name,
                seconds * 1e3,
                call.size,
                call.bytes_out,
                call.request_id,
                extra={
                    "request_id": call.request_id,
                    "rpc_method": self.method,
                    "rpc_group": group,
                    "rpc_code": name,
                    "duration_ms": seconds * 1e3,
                },
            )
        try:
            if self.recorder.registry is not None:  # the reason only when recorded
                reason = None if name == "OK" else reason_of(context)
                self.recorder.record(self.method, call, group, name, seconds, reason)
        except Exception:  # noqa: BLE001 - metrics must never fail a call
            log.exception("recording metrics for %s failed", self.method)


class _ObservedStream(_Observed):
    """The calls of a method with a response stream: each message's bytes are
    counted as it goes."""

    __slots__ = ()
    resp_s = True

    def reply(self, call: Call, msg: Any) -> Any:
        call.bytes_out += message_bytes(msg)
        return msg


_STATUS_DETAILS = "grpc-status-details-bin"
_REASON = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def reason_of(context: grpc.ServicerContext) -> str | None:
    """The ErrorInfo reason of the status a call ended with (None: it has none).
    The server writes the reasons, so they are a fixed set of label values."""
    for key, value in context.trailing_metadata() or ():
        if key != _STATUS_DETAILS:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                return info.reason if _REASON.fullmatch(info.reason) else None
    return None


def _metrics_host(address: str) -> str:
    if not is_loopback(address):
        host = address.rsplit(":", 1)[0]
        return host.strip("[]")
    host = address.rsplit(":", 1)[0].strip("[]")
    return "::1" if host == "::1" else "127.0.0.1"


class MetricsEndpoint:
    """The HTTP endpoint Prometheus scrapes, serving one recorder's registry."""

    def __init__(self, registry: CollectorRegistry, port: int, address: str) -> None:
        self._httpd, self._thread = start_http_server(
            port, addr=_metrics_host(address), registry=registry
        )
        self.port: int = self._httpd.server_port
        log.info(
            "metrics on http://%s:%d/metrics", self._httpd.server_address[0], self.port
        )

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
