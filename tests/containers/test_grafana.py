"""deploy/grafana/onnxps.json queries only metrics a real server exports: a server
process with ``--metrics-port 0`` and a write-ahead log is pushed to (and refused
once), scraped, and every metric name in every PromQL expression of the dashboard
(panels and variables) must be among the series of the scrape."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import start_server, stop
from onnxps.client import Adam, Client
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "onnxps.json"
METRIC = re.compile(r"\bonnxps_\w+")
METRICS_LINE = re.compile(r"metrics on http://([\d.]+):(\d+)/metrics")


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets (rows' panels too) and the
    variables' queries."""
    found = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels += panel.get("panels", [])
        found += [t["expr"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            found.append(query["query"])
    return found


def scraped_series(tmp_path: Path) -> set[str]:
    log = tmp_path / "server.log"
    data = str(tmp_path / "data")
    proc, address = start_server(
        log, "--metrics-port", "0", "--durability", "wal", "--data-dir", data
    )
    try:
        with Client(address, timeout=30) as ps:
            ps.create_group(
                "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3, np.float32)}
            )
            t = ps.push("g", np.ones(3, np.float32))
            ps.push("g", np.ones(3, np.float32), base_version=t)
            with pytest.raises(ValueError):
                ps.push("g", np.ones(4, np.float32))  # an error, with its reason
            ps.pull("g")
        found = METRICS_LINE.search(log.read_text())
        assert found, log.read_text()
        url = f"http://{found.group(1)}:{found.group(2)}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    finally:
        stop(proc)
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_dashboard_query_names_a_metric_the_server_exports(
    tmp_path: Path,
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    series = scraped_series(tmp_path)
    used = set()
    for expr in exprs:
        names = set(METRIC.findall(expr))
        assert names, expr  # every query reads an onnxps metric
        assert sorted(names - series) == [], expr
        assert expr.count("(") == expr.count(")"), expr
        assert expr.count("{") == expr.count("}"), expr
        used |= names
    # what the dashboard is for (issue 25, "Operations at a glance")
    assert {
        "onnxps_pushes_total",
        "onnxps_group_push_duration_seconds_bucket",
        "onnxps_push_staleness_bucket",
        "onnxps_waiting_calls",
        "onnxps_inflight_bytes",
        "onnxps_wal_fsync_duration_seconds_bucket",
        "onnxps_errors_total",
        "onnxps_gradient_pool_bytes",
    } <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
