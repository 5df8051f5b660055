"""Build, start and stop an onnxps server: ``create_server(config)`` and ``serve``."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from onnxps.client.codec import CHUNK_BYTES
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from . import durability, limits, metrics, security
from ._handlers import SERVICE
from ._reflection import enable_reflection
from .service import ParameterServerServicer
from .store import ParameterStore, StoreLimits

__all__ = ["ServerConfig", "ServerHandle", "create_server", "serve"]

log = logging.getLogger("onnxps.server")

SERVICE_NAME = SERVICE  # kept for durability's health updates


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server is started with. The CLI builds it from flags/ONNXPS_*."""

    address: str = "127.0.0.1:50051"
    threads: int = 64
    max_message_bytes: int = 256 * 1024 * 1024
    chunk_bytes: int = CHUNK_BYTES
    max_concurrent_rpcs: int = 256
    # backpressure (0: none): bytes of requests being handled at once, and streams
    max_inflight_bytes: int = 4 << 30
    max_concurrent_streams: int = 64
    # state limits (0: none)
    max_group_bytes: int = 0
    max_total_bytes: int = 0
    max_groups: int = 0
    lease_seconds: float = 10.0
    # durability
    data_dir: str | None = None
    durability: str = "none"  # none | snapshot | wal
    snapshot_interval: float = 300.0
    keep_snapshots: int = 3
    # security
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tokens_file: str | None = None
    insecure: bool = False
    # observability
    metrics_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerHandle:
    """A bound, not yet started server with what it serves."""

    server: grpc.Server
    port: int
    store: ParameterStore
    config: ServerConfig
    health: health.HealthServicer
    on_stop: list[Any] = field(default_factory=list)
    metrics_port: int | None = None  # the bound metrics port, when serving metrics
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def start(self) -> ServerHandle:
        self.server.start()
        self.store.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info("onnxps listening on %s", self.address)
        return self

    def stop(self, grace: float | None = 10.0) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace``, close."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        done = self.server.stop(grace)
        self.store.drain()
        done.wait()
        for hook in self.on_stop:
            hook()
        self.store.close()
        log.info("onnxps on %s stopped", self.address)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> ServerHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=1.0)


def _options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def create_server(config: ServerConfig | None = None) -> ServerHandle:
    """Build and bind a server without starting it (port 0 picks a free port)."""
    config = config or ServerConfig()
    security.check_bind_policy(config)
    store = ParameterStore(
        StoreLimits(
            max_group_bytes=config.max_group_bytes,
            max_total_bytes=config.max_total_bytes,
            max_groups=config.max_groups,
            default_lease_seconds=config.lease_seconds,
        )
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.threads, thread_name_prefix="onnxps-rpc"
        ),
        options=_options(config),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        # outermost first: observe every call (auth refusals too), then auth, limits
        interceptors=[
            *metrics.interceptors(config),
            *security.interceptors(config),
            *limits.interceptors(config),
        ],
    )
    servicer = ParameterServerServicer(store, chunk_bytes=config.chunk_bytes)
    pb_grpc.add_ParameterServerServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((SERVICE, health.SERVICE_NAME), server)
    credentials = security.server_credentials(config)
    if credentials is None:
        port = server.add_insecure_port(config.address)
    else:
        port = server.add_secure_port(config.address, credentials)
    if port == 0:
        raise OSError(f"could not bind {config.address}: is the port in use?")
    handle = ServerHandle(server, port, store, config, health_servicer)
    durability.attach(handle, servicer)
    metrics.attach(handle)
    return handle


def serve(config: ServerConfig | None = None) -> int:
    """Start a server and run until SIGTERM/SIGINT; then drain and exit 0."""
    handle = create_server(config).start()
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        log.info("received %s: draining in-flight calls", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    stop.wait()
    handle.stop(grace=10.0)
    return 0
