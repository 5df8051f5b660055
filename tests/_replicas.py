"""Replica sets of ``onnxps serve`` processes on a real etcd, for the replication tests
of every folder: ``ReplicaSet`` (its fixture ``replicas`` is in tests/conftest.py), the
workers that push to one and what they acknowledged, and readiness checks over gRPC
health. Moved here from test_replication.py and test_replication_ready.py so that no
test module imports another."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from _etcd import EtcdProcess
from _procs import clean_env, start_server, stop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.client import (
    Adagrad,
    Client,
    NotFoundError,
    UnavailableError,
)
from onnxps.server._health import READY
from onnxps.server.app import ServerConfig, create_server

WORKER = Path(__file__).parent / "workers" / "replica_pusher.py"


SIZE = 64


TTL = 2


def _etcd_get(etcd: EtcdProcess, key: str) -> bytes | None:
    got = etcd.gateway().get(key)
    return got[0] if got else None


class ReplicaSet:
    """``n`` servers of shard 0/1 under one etcd prefix, each with its data dir."""

    def __init__(
        self,
        tmp: Path,
        etcd: EtcdProcess,
        n: int,
        prefix: str = "ps",
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.tmp, self.etcd, self.prefix = tmp, etcd, prefix
        self.extra, self.env = extra, env or {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.addresses: dict[int, str] = {}
        self.starts = dict.fromkeys(range(n), 0)
        for i in range(n):
            self.start(i)

    @property
    def url(self) -> str:
        return self.etcd.url(self.prefix)

    def start(self, i: int) -> None:
        self.starts[i] += 1
        log = self.tmp / f"server{i}-{self.starts[i]}.log"
        proc, address = start_server(
            log,
            "--durability", "wal",
            "--data-dir", str(self.tmp / f"data{i}"),
            "--coordinator", self.url,
            "--shard", "0/1",
            "--member-id", f"m{i}",
            "--lease-ttl", str(TTL),
            "--snapshot-interval", "0",
            *self.extra,
            env=clean_env(**self.env),
        )  # fmt: skip
        self.procs[i], self.addresses[i] = proc, address

    def key(self, name: str) -> object:
        raw = _etcd_get(self.etcd, f"/{self.prefix}/shards/0/{name}")
        return None if raw is None else json.loads(raw)

    def primary(self, timeout: float = 30.0, not_: int | None = None) -> int:
        """The index of the primary (waits for one, other than ``not_``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.key("primary")
            if isinstance(info, dict):
                i = int(str(info["member"])[1:])
                if i != not_ and self.procs[i].poll() is None:
                    return i
            time.sleep(0.05)
        raise AssertionError(f"no primary (other than {not_}) within {timeout} s")

    def wait_sync(self, timeout: float = 60.0) -> list[str]:
        """Wait until the primary names a synchronous standby; returns them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.key("sync")
            primary = self.key("primary")
            if (
                isinstance(info, dict)
                and isinstance(primary, dict)
                and info["standbys"]
                and info["term"] == primary["term"]
            ):
                return list(info["standbys"])
            time.sleep(0.05)
        raise AssertionError(f"no synchronous standby within {timeout} s")

    def state(self, i: int, group: str) -> tuple[int, np.ndarray]:
        with Client(self.addresses[i], timeout=30) as c:
            return c.describe_group(group).update_count, c.pull(group)[0]

    def wait_t(self, i: int, group: str, t: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        seen = -1
        while time.monotonic() < deadline:
            try:
                seen = self.state(i, group)[0]
            except NotFoundError:  # a standby adopting a snapshot: groups reappear
                seen = -1
            except UnavailableError:  # a replica just restarted, not listening yet
                seen = -1
            if seen == t:
                return
            time.sleep(0.05)
        raise AssertionError(f"replica {i} of {group} is at T={seen}, not {t}")

    def create_group(self) -> None:
        """Group "g" (Adagrad, ``SIZE`` zeros), created through etcd."""
        _create(self.url)

    def primary_with_group(self) -> int:
        """The primary's index, once it names a synchronous standby and group "g"
        is created (``create_group``): the set-up of most replication tests."""
        p = self.primary()
        self.wait_sync()
        self.create_group()
        return p

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
            stop(p)


def _create(url: str, group: str = "g") -> None:
    with Client(url, timeout=60) as c:
        c.create_group(
            group,
            Adagrad(),
            learning_rate=0.1,
            tensors={"x": np.zeros(SIZE, np.float32)},
        )


def _serial(gradients: list[np.ndarray]) -> np.ndarray:
    """X after these pushes one after the other, on a fresh in-process server."""
    handle = create_server(ServerConfig(address="127.0.0.1:0", durability="none"))
    handle.start()
    try:
        with Client(handle.address, timeout=30) as c:
            c.create_group(
                "g", Adagrad(), learning_rate=0.1,
                tensors={"x": np.zeros(SIZE, np.float32)},
            )  # fmt: skip
            for g in gradients:
                c.push("g", g)
            return c.pull("g")[0]
    finally:
        handle.stop(grace=0)


def _replay(records: list[dict[str, int]]) -> np.ndarray:
    """X after the workers' pushes in T order (``_serial``)."""
    from workers.replica_pusher import gradient

    ordered = sorted(records, key=lambda r: r["t"])
    return _serial([gradient(r["w"], r["k"], SIZE) for r in ordered])


def _acked(out: Path) -> list[dict[str, int]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line]


def _wait_acked(out: Path, n: int, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while len(_acked(out)) < n:
        assert time.monotonic() < deadline, f"only {len(_acked(out))} of {n} acked"
        assert all(p.poll() in (None, 0) for p in procs), "a worker failed"
        time.sleep(0.05)


def _workers(
    url: str, n: int, count: int, out: Path, stop: Path | None = None
) -> list[subprocess.Popen[bytes]]:
    """``n`` workers of ``count`` pushes each (fewer once ``stop`` exists)."""
    procs = []
    for w in range(n):
        args = [str(WORKER), url, "g", str(w), str(count), str(SIZE), str(out)]
        args += [str(stop)] if stop is not None else []
        with open(out.with_suffix(f".w{w}.err"), "wb") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    env=clean_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    return procs


def _metrics_text(log: Path) -> str:
    import re
    import urllib.request

    found = re.search(r"metrics on (http://\S+/metrics)", log.read_text())
    assert found, log.read_text()[-2000:]
    with urllib.request.urlopen(found.group(1), timeout=10) as r:
        return str(r.read().decode())


def _kill(rs: ReplicaSet, i: int) -> None:
    rs.procs[i].kill()
    rs.procs[i].wait()


SERVING = health_pb2.HealthCheckResponse.SERVING


ADMIN, REPLICATION = "adm-71c0e2", "rep-3fa9d1"


def _check(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def _wait_ready(address: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _check(address, READY) != SERVING:
        assert time.monotonic() < deadline, f"{address} not ready within {timeout} s"
        time.sleep(0.05)


def _wait_log(log: Path, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while (found := re.search(pattern, log.read_text())) is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return found
