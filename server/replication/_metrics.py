"""Prometheus gauges of a replica set member (read when scraped)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ReplicationCollector"]


class ReplicationCollector(Collector):
    """``onnxps_replica_role``, ``_term``, ``_lsn``, ``_failovers_total`` and, on a
    primary, ``onnxps_replica_standby_lag_records{member}`` and
    ``onnxps_replica_sync_standbys``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        s = self.snapshot()
        role = GaugeMetricFamily(
            "onnxps_replica_role",
            "1 for this server's role in its shard's replica set",
            labels=["role"],
        )
        for name in ("primary", "standby", "stopped"):
            role.add_metric([name], 1.0 if s["role"] == name else 0.0)
        yield role
        yield GaugeMetricFamily(
            "onnxps_replica_term", "The term (epoch) this server knows", value=s["term"]
        )
        yield GaugeMetricFamily(
            "onnxps_replica_lsn",
            "The last log record this server holds",
            value=s["lsn"],
        )
        yield CounterMetricFamily(
            "onnxps_replica_failovers",
            "Times this server took the lead",
            value=s["failovers"],
        )
        lag = GaugeMetricFamily(
            "onnxps_replica_standby_lag_records",
            "On a primary: records each following standby has yet to acknowledge",
            labels=["member"],
        )
        for member, behind in sorted(s["lag"].items()):
            lag.add_metric([member], float(behind))
        yield lag
        yield GaugeMetricFamily(
            "onnxps_replica_sync_standbys",
            "On a primary: synchronous standbys following it",
            value=s["sync"],
        )

    def describe(self) -> Iterable[Any]:
        return []
