"""Shared fixtures, for every folder of tests: a real server on 127.0.0.1 port 0 and a
client connected to it, a silent port, an etcd, a test PKI and replica sets of
``onnxps serve`` processes. Being the root conftest.py, it also puts tests/ on
``sys.path``: the support modules here (``_procs``, ``_etcd``, ``_pki``,
``_replicas``, ``_servers`` ...) are imported by name from any folder; no test module
imports another."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from _etcd import INSTALL_HINT, EtcdProcess, HoldingProxy, etcd_binary, start_etcd
from _pki import Pki, issue
from _procs import StartServer, start_server, stop
from _replica_sets import Replicas
from _replicas import ReplicaSet
from _reshard import EtcdCluster
from onnxps.client import Client
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc


@pytest.fixture
def server() -> Iterator[ServerHandle]:
    """A started in-process server without durability; stopped after the test."""
    handle = create_server(ServerConfig(address="127.0.0.1:0", durability="none"))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop(grace=0)


@contextmanager
def _started_servers() -> Iterator[Callable[..., ServerHandle]]:
    started: list[ServerHandle] = []

    def start(config: ServerConfig | None = None, **fields: Any) -> ServerHandle:
        if config is None:
            fields = {"address": "127.0.0.1:0", "durability": "none", **fields}
            config = ServerConfig(**fields)
        handle = create_server(config).start()
        started.append(handle)
        return handle

    try:
        yield start
    finally:
        for handle in reversed(started):
            handle.stop(grace=0)


@pytest.fixture
def servers() -> Iterator[Callable[..., ServerHandle]]:
    """``servers(config)``, or ``servers(**fields)`` (a ``ServerConfig`` on 127.0.0.1
    port 0 without durability unless the fields say otherwise): a started in-process
    server; every one started is stopped after the test, the last first (a test
    may stop one itself before: a second stop does nothing)."""
    with _started_servers() as start:
        yield start


@pytest.fixture(scope="module")
def module_servers() -> Iterator[Callable[..., ServerHandle]]:
    """``servers`` for a module-scoped fixture: the servers started are stopped
    after the module's last test."""
    with _started_servers() as start:
        yield start


@pytest.fixture
def server_processes() -> Iterator[StartServer]:
    """``server_processes(log, *flags, env=None)``: ``onnxps serve`` on 127.0.0.1
    port 0 as a process (``_procs.start_server``), its process and address; every
    one started is killed after the test (one the test stopped itself: left so)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(
        log: Path, *args: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], str]:
        proc, address = start_server(log, *args, env=env)
        started.append(proc)
        return proc, address

    try:
        yield start
    finally:
        for proc in reversed(started):
            stop(proc)


@pytest.fixture
def stub(server: ServerHandle) -> Iterator[pb_grpc.ParameterServerServiceStub]:
    """The raw generated stub of ``server``, for requests the client library would
    never build."""
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.ParameterServerServiceStub(channel)


@pytest.fixture
def client(server: ServerHandle) -> Iterator[Client]:
    """A client of ``server`` with a 30 s default deadline; closed after the test."""
    with Client(server.address, timeout=30.0) as c:
        yield c


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A TCP port that accepts connections and never speaks HTTP/2."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A started etcd on free loopback ports with its data in ``tmp_path``."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    etcd = start_etcd(binary, tmp_path)
    try:
        yield etcd
    finally:
        etcd.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path, etcd_server: EtcdProcess) -> Iterator[EtcdCluster]:
    """An ``EtcdCluster`` on ``etcd_server`` (prefix /ps), with no shard started yet;
    every shard server it started is stopped after the test."""
    cluster = EtcdCluster(tmp_path, etcd_server)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd_proxy(etcd_server: EtcdProcess) -> Iterator[HoldingProxy]:
    """A ``HoldingProxy`` in front of ``etcd_server``: members given its address
    (``etcd://127.0.0.1:{port}/...``) have their reads or lease renewals held when
    the test says so."""
    p = HoldingProxy(etcd_server.endpoint)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA, a certificate for 127.0.0.1 it signed and a rogue one (``_pki.Pki``)."""
    d = tmp_path / "pki"
    d.mkdir()
    ca, _, ca_key = issue(d, "replica-ca", None, ca=True)
    _, _, rogue_ca_key = issue(d, "rogue-ca", None, ca=True)
    cert, key, _ = issue(d, "server", ("replica-ca", ca_key))
    rogue_cert, rogue_key, _ = issue(d, "rogue", ("rogue-ca", rogue_ca_key))
    return Pki(ca, cert, key, rogue_cert, rogue_key)


@pytest.fixture
def replicas(
    tmp_path: Path,
    etcd_server: EtcdProcess,
) -> Iterator[ReplicaSet]:
    """``replicas(n, **kwargs)``: a ``ReplicaSet`` of n ``onnxps serve`` processes on
    ``etcd_server``; every one made is closed after the test."""
    sets: list[ReplicaSet] = []

    def make(n: int, **kwargs: object) -> ReplicaSet:
        sets.append(ReplicaSet(tmp_path, etcd_server, n, **kwargs))  # type: ignore[arg-type]
        return sets[-1]

    try:
        yield make  # type: ignore[misc]
    finally:
        for s in sets:
            s.close()


@pytest.fixture
def replica_sets(
    tmp_path: Path,
    etcd_server: EtcdProcess,
) -> Iterator[Any]:
    """``replica_sets(n, **kwargs)``: a ``Replicas`` (members with their own flags,
    env, etcd address); every one made is closed after the test."""
    made: list[Replicas] = []

    def make(n: int, **kwargs: Any) -> Replicas:
        made.append(Replicas(tmp_path, etcd_server, n, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for s in made:
            s.close()
