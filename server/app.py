"""Build, start and stop an onnxps server: ``create_server(config)`` and ``serve``.

The configuration and its checks are in ``config`` (``ServerConfig``); this module
wires the parts of a server together from one. ``ServerConfig``, ``validate_config``,
``thread_limits`` and ``MIN_MESSAGE_BYTES`` are importable from here too."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from . import _malloc
from ._health import Health, health_host
from ._health import health_server as health_server_of
from ._reflection import enable_reflection
from .config import (
    MIN_MESSAGE_BYTES,
    ServerConfig,
    _port_of,
    thread_limits,
    validate_config,
)
from .durability import MODES as DURABILITY_MODES
from .durability import Durability
from .interceptors import security
from .interceptors._handlers import SERVICE, HookChain, HookInterceptor
from .interceptors._stall import StallWatch
from .interceptors.limits import DrainGate, InflightBytes, LimitsInterceptor
from .interceptors.security import ConfigError
from .interceptors.shard import ShardInterceptor, parse_shard
from .kernels import load_in_background
from .metrics import (
    DurabilityCollector,
    LoadCollector,
    MetricsEndpoint,
    ObserveInterceptor,
    Recorder,
)
from .rpc.service import ParameterServerServicer, add_servicer
from .store import ParameterStore, StoreLimits
from .transports._datachannel import (
    ChannelTable,
    DataChannels,
    listen,
    tls_context,
)
from .transports._frames import FrameCalls
from .transports._receive import GradientPool
from .transports._shm import SharedMemory
from .transports._unix import UnixSocket

__all__ = [
    "MIN_MESSAGE_BYTES",
    "ServerConfig",
    "ServerHandle",
    "create_server",
    "serve",
    "thread_limits",
    "validate_config",
]

log = logging.getLogger("onnxps.server")


@dataclass
class ServerHandle:
    """A bound, not yet started server and the parts it owns (stopped in order)."""

    server: grpc.Server
    port: int
    config: ServerConfig
    store: ParameterStore
    health: Health
    durability: Durability | None = None
    metrics: MetricsEndpoint | None = None
    gate: DrainGate = field(default_factory=DrainGate)
    health_server: grpc.Server | None = None
    health_port: int | None = None
    shared_memory: SharedMemory | None = None
    unix_socket: UnixSocket | None = None
    data_channels: DataChannels | None = None
    stall: StallWatch | None = None
    replication: Any = None  # onnxps.server.replication.Replication
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        if self.unix_socket is not None or self.config.address.startswith("unix"):
            return self.config.address
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def advertised_address(self) -> str:
        """Where clients and standbys reach this server (what etcd names)."""
        return self.config.advertise_address or self.address

    @property
    def data_port(self) -> int | None:
        """The bound data channel port, when serving one."""
        return None if self.data_channels is None else self.data_channels.port

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port, when serving metrics."""
        return None if self.metrics is None else self.metrics.port

    def start(self) -> ServerHandle:
        if self.stall is not None:
            self.stall.start()
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()
            host = health_host(self.config.address)
            log.info("onnxps health (plaintext) on %s:%d", host, self.health_port)
        self.store.start()
        if self.shared_memory is not None:
            self.shared_memory.start()
        if self.data_channels is not None:
            self.data_channels.start()
        if self.durability is not None:
            self.durability.start_periodic(self.config.snapshot_interval)
        if self.replication is not None:
            try:
                self.replication.start(self.advertised_address)
            except BaseException:
                self.stop(grace=0)
                raise
        self.health.set_serving(True)
        log.info("onnxps listening on %s", self.address)
        return self

    def stop(self, grace: float | None = 10.0) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace``, close:
        the RPC server, the metrics endpoint, durability (a last snapshot), the store.

        The order matters: health says NOT_SERVING and the gate answers every new
        call UNAVAILABLE (clients retry it) while the server still runs; waiting calls
        are woken; only when the admitted calls have finished (or ``grace`` ran out)
        is the gRPC server stopped, so it has nothing left to cancel.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.replication is not None:
            self.replication.stop()  # a primary resigns: a standby takes over now
        end = None if grace is None else time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        self.gate.close()
        self.store.drain()
        if end is not None and not self.gate.wait_idle(end - time.monotonic()):
            log.warning(
                "%d calls still running after the %g s grace: cancelling them",
                self.gate.running,
                grace,
            )
        left = None if end is None else max(0.0, end - time.monotonic())
        self.server.stop(left).wait()
        if self.unix_socket is not None:
            self.unix_socket.remove()
        if self.shared_memory is not None:
            self.shared_memory.stop()
        if self.data_channels is not None:
            self.data_channels.close()
        if self.stall is not None:
            self.stall.stop()
        if self.health_server is not None:
            self.health_server.stop(0).wait()
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


def _options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # A client of a replicated cluster pings every second while its call waits
        # (a push waiting for a standby sends no data): take those pings, so that
        # a frozen primary, which answers none, is found out within seconds.
        ("grpc.http2.min_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _durability(
    config: ServerConfig, store: ParameterStore, status: Health
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

    def set_serving(serving: bool) -> None:
        status.set_serving(serving)

    d = Durability(
        store,
        config.data_dir,
        mode=config.durability,
        keep=config.keep_snapshots,
        keep_seconds=config.keep_seconds,
        keep_bytes=config.keep_bytes,
        set_serving=set_serving,
        truncate_corrupt=config.wal_truncate_corrupt,
    )
    d.open()
    return d


def create_server(config: ServerConfig | None = None) -> ServerHandle:
    """Build every part of a server and bind it, without starting it (port 0 picks a
    free port). This is the one place the parts are wired together.

    numba's fused kernels start loading on a thread here (unless ``ONNXPS_KERNELS``
    says numpy): until they are in, steps take the NumPy path (the same bits), so
    no call of a server, embedded or ``onnxps serve``, waits for them to compile."""
    load_in_background()
    config = config or ServerConfig()
    security.check_bind_policy(config)
    credentials = security.server_credentials(config)
    grants = security.load_tokens(config.tokens_file) if config.tokens_file else None
    shard = parse_shard(config.shard) if config.shard else None
    if shard is not None:
        log.info("this server is shard %d of %d", shard.index, shard.count)
    max_streams, max_waiting = thread_limits(config)
    store = ParameterStore(
        StoreLimits(
            max_group_bytes=config.max_group_bytes,
            max_total_bytes=config.max_total_bytes,
            max_groups=config.max_groups,
            default_lease_seconds=config.lease_seconds,
            max_waiting_calls=max_waiting,
        )
    )
    inflight = InflightBytes(config.max_inflight_bytes)
    gradient_pool = GradientPool(config.gradient_pool_bytes)
    stall = StallWatch(config.stall_seconds)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    recorder = Recorder(store, enabled=config.metrics_port is not None)
    # outermost first: observe every call (auth refusals too), then auth, limits
    gate = DrainGate()  # a graceful stop refuses new calls here first
    if recorder.registry is not None:
        recorder.registry.register(
            LoadCollector(
                lambda: gate.running,
                lambda: inflight.held,
                lambda: store.waiting_calls,
                lambda: gradient_pool.idle_bytes,
            )
        )
    interceptors: list[HookInterceptor] = [ObserveInterceptor(recorder), gate]
    if grants is not None:
        interceptors.append(security.TokenAuthInterceptor(grants))
    # a cluster found through etcd changes its shard count by resharding: the
    # index a call was routed to is checked, not the count it routed for
    interceptors.append(ShardInterceptor(shard, any_count=bool(config.coordinator)))
    interceptors.append(
        LimitsInterceptor(
            max_concurrent_streams=max_streams, inflight=inflight, stall=stall
        )
    )
    chain = HookChain(interceptors)
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.threads, thread_name_prefix="onnxps-rpc"
        ),
        options=_options(config),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        # one interceptor: every call wrapped once (``_handlers.HookChain``)
        interceptors=[chain],
    )
    status = Health(health_servicer, replicated=bool(config.coordinator))
    durability = _durability(config, store, status)
    if durability is not None and recorder.registry is not None:
        # the journal is read at each scrape: a standby adopting a snapshot opens
        # a new one
        recorder.registry.register(
            DurabilityCollector(
                durability.alarms,
                lambda: (
                    None
                    if durability.journal is None
                    else durability.journal.fsync_times
                ),
                durability.retained_bytes,
            )
        )
    # A crash between a sync step's last push record and the step's own record leaves
    # a full quorum pending after replay: take such steps before serving anything.
    store.reap_leases()
    replication = _replication(
        config, shard, store, durability, recorder.registry, status.set_caught_up
    )
    metrics = None
    shared_memory = SharedMemory(
        enabled=config.shared_memory == "on",
        idle_seconds=config.shared_memory_idle_seconds,
    )
    unix_socket = None
    data_channels = None
    listener, table = None, None
    try:
        listener, table = _data_listener(config)
        servicer = ParameterServerServicer(
            store,
            chunk_bytes=config.chunk_bytes,
            save=None if durability is None else durability.save,
            durability=durability,
            inflight=inflight,
            gradient_pool=gradient_pool,
            shared_memory=shared_memory,
            data_channels=table,
            replicate=_replicate_of(replication),
        )
        handlers = add_servicer(servicer, server)
        if listener is not None and table is not None:
            data_channels = _data_channels(config, listener, table, chain, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection((SERVICE, health.SERVICE_NAME), server)
        unix_socket = UnixSocket.of(config.address, config.unix_socket_mode)
        if unix_socket is not None:
            port = unix_socket.bind(lambda: _bind(server, config.address, credentials))
        else:
            port = _bind(server, config.address, credentials)
        health_server, health_port = health_server_of(
            config.address, config.health_port, health_servicer, _bind
        )
        if config.metrics_port is not None and recorder.registry is not None:
            metrics = _metrics_endpoint(recorder.registry, config)
    except BaseException:
        if data_channels is not None:
            data_channels.close()
        elif listener is not None:
            listener.close()
        if durability is not None:
            durability.close()
        store.close()
        raise
    return ServerHandle(
        server,
        port,
        config,
        store,
        status,
        durability,
        metrics,
        gate,
        health_server=health_server,
        health_port=health_port,
        shared_memory=shared_memory,
        unix_socket=unix_socket,
        data_channels=data_channels,
        stall=stall,
        replication=replication,
    )


def _data_listener(
    config: ServerConfig,
) -> tuple[socket.socket, ChannelTable] | tuple[None, None]:
    """Unless --data-port off (or a unix: address): the data channel's listening
    socket, and the table of its tickets and channels that the servicer's calls
    use."""
    port = config.data_port_number
    if port is None:
        return None, None
    host = config.address.rsplit(":", 1)[0].strip("[]")
    listener = listen(host, port)
    return listener, ChannelTable(listener.getsockname()[1])


def _data_channels(
    config: ServerConfig,
    listener: socket.socket,
    table: ChannelTable,
    chain: HookChain,
    handlers: dict[str, Any],
) -> DataChannels:
    """The data channel's listener, given all it serves: the table, TLS (the
    server's certificate and client CA, as gRPC) and, on call channels, small Push
    and Pull as frames through the same interceptors and handlers as gRPC."""
    tls = None
    if config.tls_cert and config.tls_key:
        tls = tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
    return DataChannels(
        listener,
        table,
        tls,
        frame_calls=FrameCalls(chain, handlers),
        stall_seconds=config.stall_seconds,
    )


def _replication(config: ServerConfig, *args: Any) -> Any:
    """The replica set part (None without --coordinator; imported only then):
    ``replication.from_server_config``'s arguments after the config."""
    if not config.coordinator:
        return None
    from .replication import from_server_config

    return from_server_config(config, *args)


def _replicate_of(replication: Any) -> Any:
    """The Replicate stream's handler (None: the server answers NOT_REPLICATED)."""
    return None if replication is None else replication.replicate


def _bind(
    server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Listen on ``address``; a port in use is an ``OSError`` that says so (checked
    first with a plain socket, so gRPC does not log its own error line)."""
    _check_free(address)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(
            f"cannot listen on {address}: the port is in use, or the host is not an "
            "address of this machine"
        )
    return port


def _check_free(address: str) -> None:
    port = _port_of(address)
    if not port:  # unix: sockets, and port 0 (any free port)
        return
    host = address.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return  # gRPC reports what it cannot resolve
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    exc.errno,
                    f"cannot listen on {address}: the port is in use (is another "
                    "server running? pass another --address)",
                ) from None


def _metrics_endpoint(registry: Any, config: ServerConfig) -> MetricsEndpoint:
    assert config.metrics_port is not None
    try:
        return MetricsEndpoint(registry, config.metrics_port, config.address)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot serve metrics on port {config.metrics_port}: "
            f"{exc.strerror or exc} (--metrics-port)",
        ) from exc


def serve(config: ServerConfig | None = None) -> int:
    """Start a server and run until SIGTERM/SIGINT; then drain and exit 0."""
    _malloc.tune()  # this process owns its allocator (see ``_malloc``)
    # numba's kernels load while the data directory is restored and the replica set
    # joined: steps take the NumPy path (the same bits) until they are in.
    load_in_background()
    handle = create_server(config).start()
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        log.info("received %s: draining in-flight calls", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    # The kernel may hand the signal to any thread (gRPC's, numba's), and Python runs
    # its handler only when the main thread next runs Python code: an untimed wait
    # would sleep through it. A timed wait wakes to run a pending handler.
    while not stop.wait(0.25):
        pass
    handle.stop(grace=10.0)
    return 0
