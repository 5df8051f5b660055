"""Readiness of a replica (issue 23): the health service ``onnxps.ready`` is SERVING
on the primary, and on a standby only once it holds what the primary had logged, so
that Kubernetes' readiness probe (and a rolling update) waits for a restarted replica
to catch up. Real etcd, real ``onnxps serve`` processes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _replicas import (
    ADMIN,
    REPLICATION,
    SERVING,
    SIZE,
    ReplicaSet,
    _check,
    _kill,
    _wait_log,
    _wait_ready,
)
from grpc_health.v1 import health_pb2
from onnxps.client import Adagrad, Client
from onnxps.server._health import READY
from onnxps.server.app import ServerConfig, ServerHandle

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.slow
def test_a_standby_is_ready_only_while_it_holds_what_the_primary_logged(
    replicas: Any,
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin *\n{REPLICATION} replication *\n")
    rs: ReplicaSet = replicas(
        2,
        extra=("--tokens-file", str(tokens), "--sync-replicas", "0"),
        env={"ONNXPS_REPLICATION_TOKEN": REPLICATION},
    )
    p = rs.primary()
    s = 1 - p
    _wait_ready(rs.addresses[p])
    _wait_ready(rs.addresses[s])
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30, token=ADMIN) as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": 0 * g})
        _kill(rs, s)
        for _ in range(5):
            c.push("g", g)  # the standby misses these
    # Restarted with a token the primary refuses, the standby cannot follow: it
    # serves (reads, and refusing writes) but is not ready.
    rs.env["ONNXPS_REPLICATION_TOKEN"] = "rep-wrong"
    rs.start(s)
    log = tmp_path / f"server{s}-2.log"
    found = _wait_log(
        log,
        r"not ready: does not follow the primary m\d of term \d+ \(holds record "
        r"(\d+) of term \d+, the primary had logged (\d+)\)",
    )
    assert int(found.group(1)) < int(found.group(2))
    assert _check(rs.addresses[s], "") == SERVING
    assert _check(rs.addresses[s], READY) == NOT_SERVING
    assert _check(rs.addresses[p], READY) == SERVING
    # With its token it catches up, and is ready.
    _kill(rs, s)
    rs.env["ONNXPS_REPLICATION_TOKEN"] = REPLICATION
    rs.start(s)
    _wait_ready(rs.addresses[s])
    found = _wait_log(
        tmp_path / f"server{s}-3.log", r"caught up \(ready\): holds record (\d+)"
    )
    assert int(found.group(1)) >= 6  # the create and 5 pushes, durable (applied next)


def test_an_unreplicated_server_is_ready_while_it_serves(
    servers: Callable[..., ServerHandle],
) -> None:
    handle = servers(ServerConfig(address="127.0.0.1:0"))
    assert _check(handle.address, READY) == SERVING
    assert _check(handle.address, "") == SERVING
