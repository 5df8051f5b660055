"""A real etcd (Debian's ``etcd-server``) for tests: free loopback ports, a temp dir.

``etcd_server`` (a pytest fixture, import it into a test module) starts one etcd per
test and stops it after; without the binary the test is skipped with how to install it.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "etcd is not installed: `apt-get install -y etcd-server` (Debian's etcd 3.4, "
    "binary /usr/bin/etcd), or put an etcd binary on PATH (ONNXPS_ETCD_BIN)"
)


def etcd_binary() -> str | None:
    import os

    return os.environ.get("ONNXPS_ETCD_BIN") or shutil.which("etcd")


_HANDED: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and port-0 binds."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a process the test starts later: picked below
    the kernel's ephemeral range, so no outgoing connection (to etcd, between
    replicas) and no port-0 bind can take it between this pick and the bind that
    uses it, as one did with a port from that range ("the port is in use"); never
    the same port twice in a test session."""
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:  # the range is taken: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdProcess:
    """One etcd member on loopback; ``endpoint`` is ``127.0.0.1:port``."""

    binary: str
    data_dir: Path
    log_path: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None
    # more client ports beside client_port (a partition can cut one of them)
    extra_client_ports: tuple[int, ...] = ()
    # serving TLS only: (certificate, key, CA its clients' certificates chain to,
    # or None for no client certificates asked for)
    tls: tuple[Path, Path, Path | None] | None = None
    # what the test's own calls present and check with ``tls``: (CA, cert, key)
    client_tls: tuple[Path, Path | None, Path | None] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def url(self, prefix: str) -> str:
        """A coordinator address: ``etcd://127.0.0.1:port/prefix`` (``etcds://``
        when serving TLS)."""
        return f"{'etcds' if self.tls else 'etcd'}://{self.endpoint}/{prefix}"

    def gateway(self, timeout: float = 5.0) -> Any:
        """An etcd3gw client of this etcd, with ``client_tls`` when serving TLS."""
        from onnxps.wire.coordinator import (
            CoordinatorAddress,
            CoordinatorTls,
            gateway_clients,
        )

        tls = None
        if self.client_tls is not None:
            tls = CoordinatorTls(*(None if f is None else str(f)
                                   for f in self.client_tls))  # fmt: skip
        address = CoordinatorAddress((("127.0.0.1", self.client_port),), "/", tls)
        return gateway_clients(address, timeout)[0]

    def start(self, timeout: float = 30.0) -> None:
        client = ",".join(
            f"{self.scheme}://127.0.0.1:{p}"
            for p in (self.client_port, *self.extra_client_ports)
        )
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name=onnxps-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={self.scheme}://{self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=onnxps-test={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.tls is not None:
            cert, key, client_ca = self.tls
            args += [f"--cert-file={cert}", f"--key-file={key}"]
            if client_ca is not None:
                args += [f"--trusted-ca-file={client_ca}", "--client-cert-auth"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode}: "
                    + self.log_path.read_text(errors="replace")[-2000:]
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd on {self.endpoint} not healthy in {timeout}s")
            time.sleep(0.05)

    def healthy(self) -> bool:
        context = None
        if self.client_tls is not None:
            ca, cert, key = self.client_tls
            context = ssl.create_default_context(cafile=str(ca))
            if cert is not None:
                context.load_cert_chain(str(cert), None if key is None else str(key))
        try:
            with urllib.request.urlopen(
                f"{self.scheme}://{self.endpoint}/health", timeout=1, context=context
            ) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def start_etcd(binary: str, tmp_path: Path, tries: int = 3, **tls: Any) -> EtcdProcess:
    """An etcd on free ports; ports picked free can be taken before etcd binds
    them, so a start that finds its port in use is tried again on others.
    ``tls``: EtcdProcess's ``tls`` and ``client_tls``."""
    for attempt in range(tries):
        data = tmp_path / f"etcd-data-{attempt}"
        log = tmp_path / "etcd.log"
        etcd = EtcdProcess(binary, data, log, free_port(), free_port(), **tls)
        try:
            etcd.start()
            return etcd
        except RuntimeError:
            etcd.stop()
            if attempt == tries - 1 or "address already in use" not in log.read_text(
                errors="replace"
            ):
                raise
    raise AssertionError("unreachable")


READ = "/v3/kv/range"
KEEPALIVE = "/v3/lease/keepalive"


class HoldingProxy:
    """etcd's HTTP gateway through a proxy that, while ``holding`` is set, holds
    every read (``READ``) until ``release`` is set; ``events`` lists what came in
    order: ("held", n), ("keepalive", n), ("released", n) (n: the read's number)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.holding = threading.Event()
        self.release = threading.Event()
        # while set, keepalives wait for ``keepalives_go`` ("keepalive held")
        self.holding_keepalives = threading.Event()
        self.keepalives_go = threading.Event()
        self.events: list[tuple[str, int]] = []
        self._cv = threading.Condition()
        self._reads = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                proxy.before(self.path)
                host, port = proxy.upstream.rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    conn.request(
                        "POST", self.path, body, {"Content-Type": "application/json"}
                    )
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a member gave up a held call (its own timeout): expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def before(self, path: str) -> None:
        if path == KEEPALIVE:
            self._record("keepalive", self._reads)
            if self.holding_keepalives.is_set():
                self._record("keepalive held", 0)
                self.keepalives_go.wait(60)
        if path != READ or not self.holding.is_set():
            return
        with self._cv:
            self._reads += 1
            n = self._reads
        self._record("held", n)
        self.release.wait(60)
        self._record("released", n)

    def _record(self, what: str, n: int) -> None:
        with self._cv:
            self.events.append((what, n))
            self._cv.notify_all()

    def wait_for(
        self, ok: Callable[[list[tuple[str, int]]], bool], timeout: float
    ) -> bool:
        """Until ``ok(events)`` (False if not within ``timeout`` seconds)."""
        with self._cv:
            return self._cv.wait_for(lambda: ok(self.events), timeout)

    def close(self) -> None:
        self.release.set()
        self.keepalives_go.set()
        self.server.shutdown()
        self.server.server_close()
