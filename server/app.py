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
from grpc_reflection.v1alpha import reflection
from onnxps.client._codec import CHUNK_BYTES
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from . import security
from ._fastwire import FastChunkInterceptor
from ._handlers import SERVICE
from .durability import Durability
from .limits import LimitsInterceptor
from .metrics import MetricsEndpoint, ObserveInterceptor, Recorder
from .security import ConfigError
from .service import ParameterServerServicer
from .store import ParameterStore, StoreLimits

__all__ = ["ServerConfig", "ServerHandle", "create_server", "serve"]

log = logging.getLogger("onnxps.server")

DURABILITY_MODES = ("none", "snapshot", "wal")


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
    """A bound, not yet started server and the parts it owns (stopped in order)."""

    server: grpc.Server
    port: int
    config: ServerConfig
    store: ParameterStore
    health: health.HealthServicer
    durability: Durability | None = None
    metrics: MetricsEndpoint | None = None
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port, when serving metrics."""
        return None if self.metrics is None else self.metrics.port

    def start(self) -> ServerHandle:
        self.server.start()
        self.store.start()
        if self.durability is not None:
            self.durability.start_periodic(self.config.snapshot_interval)
        _set_health(self.health, health_pb2.HealthCheckResponse.SERVING)
        log.info("onnxps listening on %s", self.address)
        return self

    def stop(self, grace: float | None = 10.0) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace``, close:
        the RPC server, the metrics endpoint, durability (a last snapshot), the store.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        done = self.server.stop(grace)
        self.store.drain()
        done.wait()
        if self.metrics is not None:
            self.metrics.stop()
        if self.durability is not None:
            self.durability.close()
        self.store.close()
        log.info("onnxps on %s stopped", self.address)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> ServerHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=1.0)


def _set_health(servicer: health.HealthServicer, status: Any) -> None:
    servicer.set("", status)
    servicer.set(SERVICE, status)


def _options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def _durability(
    config: ServerConfig, store: ParameterStore, health_servicer: health.HealthServicer
) -> Durability | None:
    """Restore the data directory into ``store``, when the config keeps one."""
    if config.durability not in DURABILITY_MODES:
        raise ConfigError(
            f"durability must be one of {', '.join(DURABILITY_MODES)}, got "
            f"{config.durability!r}"
        )
    if config.durability == "none":
        return None
    if not config.data_dir:
        raise ConfigError(
            f"durability {config.durability!r} needs a data directory (--data-dir)"
        )
    d = Durability(
        store,
        config.data_dir,
        mode=config.durability,
        keep=config.keep_snapshots,
        set_health=lambda status: _set_health(health_servicer, status),
    )
    d.open()
    return d


def create_server(config: ServerConfig | None = None) -> ServerHandle:
    """Build every part of a server and bind it, without starting it (port 0 picks a
    free port). This is the one place the parts are wired together."""
    config = config or ServerConfig()
    security.check_bind_policy(config)
    credentials = security.server_credentials(config)
    grants = security.load_tokens(config.tokens_file) if config.tokens_file else None
    store = ParameterStore(
        StoreLimits(
            max_group_bytes=config.max_group_bytes,
            max_total_bytes=config.max_total_bytes,
            max_groups=config.max_groups,
            default_lease_seconds=config.lease_seconds,
        )
    )
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    recorder = Recorder(store, enabled=config.metrics_port is not None)
    # outermost first: observe every call (auth refusals too), then auth, limits
    interceptors: list[grpc.ServerInterceptor] = [ObserveInterceptor(recorder)]
    if grants is not None:
        interceptors.append(security.TokenAuthInterceptor(grants))
    interceptors += [
        LimitsInterceptor(
            max_inflight_bytes=config.max_inflight_bytes,
            max_concurrent_streams=config.max_concurrent_streams,
        ),
        FastChunkInterceptor(),  # innermost: chunk parsers for the streams
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.threads, thread_name_prefix="onnxps-rpc"
        ),
        options=_options(config),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        interceptors=interceptors,
    )
    durability = _durability(config, store, health_servicer)
    metrics = None
    try:
        servicer = ParameterServerServicer(
            store,
            chunk_bytes=config.chunk_bytes,
            save=None if durability is None else durability.save_rpc,
        )
        pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        if credentials is None:
            port = server.add_insecure_port(config.address)
        else:
            port = server.add_secure_port(config.address, credentials)
        if port == 0:
            raise OSError(f"could not bind {config.address}: is the port in use?")
        if config.metrics_port is not None and recorder.registry is not None:
            metrics = MetricsEndpoint(
                recorder.registry, config.metrics_port, config.address
            )
    except BaseException:
        if durability is not None:
            durability.close()
        store.close()
        raise
    return ServerHandle(
        server, port, config, store, health_servicer, durability, metrics
    )


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
