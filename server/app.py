"""Build, start and stop an onnxps server: ``create_server(config)`` and ``serve``."""

from __future__ import annotations

import errno
import logging
import math
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from onnxps.wire.codec import CHUNK_BYTES

from . import _malloc, security
from ._datachannel import DataChannels, tls_context
from ._frames import FrameCalls
from ._gate import DrainGate
from ._handlers import SERVICE, HookChain, HookInterceptor
from ._health import Health, health_host
from ._health import health_server as health_server_of
from ._receive import GradientPool
from ._reflection import enable_reflection
from ._shm import SharedMemory
from ._stall import StallWatch
from ._unix import UnixSocket, socket_mode
from .durability import MODES as DURABILITY_MODES
from .durability import Durability
from .kernels import load_in_background
from .limits import InflightBytes, LimitsInterceptor
from .metrics import (
    DurabilityCollector,
    LoadCollector,
    MetricsEndpoint,
    ObserveInterceptor,
    Recorder,
)
from .security import ConfigError
from .service import ParameterServerServicer, add_servicer
from .shard import ShardInterceptor, parse_shard
from .store import ParameterStore, StoreLimits

__all__ = ["ServerConfig", "ServerHandle", "create_server", "serve", "validate_config"]

log = logging.getLogger("onnxps.server")


def _option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    group: str = "other",
    none: str | None = None,
) -> Any:
    """A config field with its ``onnxps serve`` flag help (the flag is ``--field-name``
    and its environment variable ``ONNXPS_FIELD_NAME``): ``group`` is its section
    of ``--help`` and of docs/configuration.md, ``none`` what a None default means."""
    metadata = {"help": help, "choices": choices, "group": group, "none": none}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server is started with. ``onnxps serve`` is generated from these
    fields (flags, ``ONNXPS_*`` variables, defaults); so is the table of
    docs/configuration.md."""

    address: str = _option(
        "127.0.0.1:50051",
        "host:port to listen on, or unix:PATH (a Unix socket)",
        group="network",
    )
    unix_socket_mode: str = _option(
        "0600",
        "permissions (octal) of the unix:PATH socket the server creates: 0600 lets "
        "its user connect, 0660 its group too",
        group="network",
    )
    shared_memory: str = _option(
        "on",
        "same-host clients of this server's user may move tensors through /dev/shm",
        choices=("on", "off"),
        group="network",
    )
    threads: int = _option(
        128,
        "RPC worker threads; streams and waiting calls may hold at most "
        "--max-concurrent-streams + --max-waiting-calls of them, the rest serve "
        "short calls and health",
        group="limits",
    )
    log_level: str = _option(
        "INFO",
        "log level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        group="observability",
    )
    max_message_bytes: int = _option(256 << 20, "largest unary message", group="limits")
    chunk_bytes: int = _option(CHUNK_BYTES, "stream chunk size", group="limits")
    max_concurrent_rpcs: int = _option(
        256, "calls in flight before RESOURCE_EXHAUSTED", group="limits"
    )
    max_inflight_bytes: int = _option(
        4 << 30,
        "request bytes handled at once before RESOURCE_EXHAUSTED, 0 for no limit",
        group="limits",
    )
    max_concurrent_streams: int | None = _option(
        None,
        "streaming calls and data-channel calls at once before RESOURCE_EXHAUSTED, "
        "0 for no limit (and no threads kept for short calls)",
        group="limits",
        none="half of --threads",
    )
    max_waiting_calls: int | None = _option(
        None,
        "calls waiting for a version at once (pull min_version, sync push with "
        "return_values) before RESOURCE_EXHAUSTED; with --max-concurrent-streams "
        "below --threads",
        group="limits",
        none="a quarter of --threads",
    )
    stall_seconds: float = _option(
        30.0,
        "a call whose client stops sending (a request stream between messages, a "
        "data-channel frame) or stops reading its data-channel frame for this long "
        "ends with DEADLINE_EXCEEDED, deadline or not",
        group="limits",
    )
    gradient_pool_bytes: int = _option(
        128 << 20,
        "idle gradient buffers kept for the next streamed or data-channel push, all "
        "groups together (reused to skip page faults; given back when the host runs "
        "low on memory), 0 for none",
        group="memory",
    )
    max_group_bytes: int = _option(
        0, "largest group (X with V/H), 0 for no limit", group="memory"
    )
    max_total_bytes: int = _option(
        0, "state the server holds in all, 0 for no limit", group="memory"
    )
    max_groups: int = _option(0, "number of groups, 0 for no limit", group="memory")
    lease_seconds: float = _option(
        10.0, "worker lease (sync quorum) when a group sets none", group="training"
    )
    data_dir: str | None = _option(
        "onnxps-data",
        "directory for snapshots and WAL",
        group="durability",
        none="no data directory",
    )
    durability: str = _option(
        "snapshot",
        "how state outlives the process",
        choices=DURABILITY_MODES,
        group="durability",
    )
    wal_truncate_corrupt: bool = _option(
        False,
        "start even when the write-ahead log is corrupt in its middle: cut it there "
        "and drop the records after it (logged as an ERROR)",
        group="durability",
    )
    snapshot_interval: float = _option(
        300.0, "seconds between snapshots, 0 for none", group="durability"
    )
    keep_snapshots: int = _option(3, "snapshots kept", group="durability")
    tls_cert: str | None = _option(
        None, "server certificate (PEM)", group="security", none="plaintext, no TLS"
    )
    tls_key: str | None = _option(
        None, "server private key (PEM)", group="security", none="plaintext, no TLS"
    )
    tls_client_ca: str | None = _option(
        None,
        "CA that client certificates must chain to (mutual TLS)",
        group="security",
        none="no client certificates asked for",
    )
    tls_ca: str | None = _option(
        None,
        "CA (PEM) that a primary's certificate chains to: with --coordinator and "
        "--tls-cert, a standby checks its primary against it (and, with "
        "--tls-client-ca, presents --tls-cert as its client certificate)",
        group="security",
        none="--tls-client-ca, else the system's roots",
    )
    tokens_file: str | None = _option(
        None,
        "token file: roles and group prefixes per token",
        group="security",
        none="no tokens: every caller may make every call",
    )
    insecure: bool = _option(
        False, "allow a non-loopback address without TLS and tokens", group="security"
    )
    metrics_port: int | None = _option(
        None,
        "serve Prometheus metrics on this port",
        group="observability",
        none="no metrics endpoint",
    )
    health_port: int | None = _option(
        None,
        "also serve grpc.health.v1 alone, in plaintext, on this port (Kubernetes' "
        "native gRPC probes cannot speak TLS); 0 picks a free port",
        group="observability",
        none="health on the main port only",
    )
    data_port: int | None = _option(
        None,
        "also serve a data channel on this TCP port of the address's host: clients "
        "that ask move tensor bytes on a socket beside gRPC (about 2x faster), "
        "TLS with the server's certificate when it serves TLS; 0 picks a free port",
        group="network",
        none="no data channel",
    )
    shard: str | None = _option(
        None,
        "this server is shard INDEX/COUNT of a cluster (from 0), or auto/COUNT to "
        "take INDEX from the host name's -<ordinal> (a StatefulSet pod); calls "
        "routed for another layout are refused",
        group="cluster",
        none="a single server, not a shard",
    )
    coordinator: str | None = _option(
        None,
        "replicate this shard: etcd://HOST:PORT[,HOST:PORT]/PREFIX (etcds:// for "
        "TLS to etcd); the servers of "
        "one prefix and --shard index elect a primary and ship it the write-ahead "
        "log (needs --durability wal and --shard; pip install 'onnxps[replication]')",
        group="replication",
        none="not replicated",
    )
    coordinator_ca: str | None = _option(
        None, "with etcds://: the CA (PEM) etcd's certificate must chain to",
        group="replication", none="the system's roots",
    )  # fmt: skip
    coordinator_cert: str | None = _option(
        None, "with etcds://: a client certificate (PEM) to present to etcd, with "
        "--coordinator-key", group="replication", none="none presented",
    )  # fmt: skip
    coordinator_key: str | None = _option(
        None, "with etcds://: the key of --coordinator-cert", group="replication",
        none="none presented",
    )  # fmt: skip
    sync_replicas: int = _option(
        1,
        "with --coordinator: standbys that must hold a change before the primary "
        "acknowledges it (fewer following: changes are refused)",
        group="replication",
    )
    sync_policy: str = _option(
        "refuse",
        "with --coordinator, when fewer than --sync-replicas standbys follow: refuse "
        "changes, or lower the count to those following and acknowledge (logged; "
        "the sync key in etcd names only those, so no acknowledged push is lost "
        "at a promotion)",
        choices=("refuse", "lower"),
        group="replication",
    )
    lease_ttl: int = _option(
        3,
        "with --coordinator: seconds of the primary's etcd lease (a failover takes "
        "about this long)",
        group="replication",
    )
    member_id: str | None = _option(
        None,
        "with --coordinator: this server's name in its replica set, stable across "
        "restarts",
        group="replication",
        none="host name and port",
    )
    replication_token: str | None = _option(
        None,
        "with --coordinator and --tokens-file: the token (role replication, prefix *) "
        "a standby presents to its primary; best set as ONNXPS_REPLICATION_TOKEN",
        group="replication",
        none="no token",
    )
    advertise_address: str | None = _option(
        None,
        "with --coordinator: host:port where clients and standbys reach this server, "
        "written to etcd (a pod's DNS name; needed when --address is a wildcard "
        "such as 0.0.0.0, which no other host can dial)",
        group="replication",
        none="the bound --address",
    )

    def __post_init__(self) -> None:
        validate_config(self)


# A chunk of a stream plus its message framing must fit in one message, and so must
# the ~1 MiB chunks every client sends by default.
MESSAGE_OVERHEAD = 64 << 10
MIN_MESSAGE_BYTES = CHUNK_BYTES + MESSAGE_OVERHEAD


def _port_of(address: str) -> int | None:
    """The port of ``host:port`` or ``[v6]:port``; None when there is none."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or host.endswith(":"):
        return None
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return None  # a bare IPv6 address without a port
    return int(port)


def _check_address(address: str) -> None:
    if address.startswith(("unix:", "unix-abstract:")):
        return
    port = _port_of(address)
    if port is None:
        raise ConfigError(
            f"address must be host:port (e.g. 127.0.0.1:50051, [::1]:50051) or "
            f"unix:PATH, got {address!r}"
        )
    if port > 65535:
        raise ConfigError(
            f"address {address!r}: the port must be 1..65535 (0 picks a free one), "
            f"got {port}"
        )


def _checks(c: ServerConfig) -> list[tuple[bool, str]]:
    """(holds, what it says) for every field with a range."""
    return [
        (
            socket_mode(c.unix_socket_mode) is not None,
            f"unix_socket_mode must be octal permissions 0000..0777 (e.g. 0600), got "
            f"{c.unix_socket_mode!r}",
        ),
        (
            c.shared_memory in ("on", "off"),
            f"shared_memory must be on or off, got {c.shared_memory!r}",
        ),
        (c.threads >= 1, f"threads must be >= 1, got {c.threads}"),
        (
            c.max_message_bytes
            >= max(MIN_MESSAGE_BYTES, c.chunk_bytes + MESSAGE_OVERHEAD),
            f"max_message_bytes must hold a stream chunk (chunk_bytes + "
            f"{MESSAGE_OVERHEAD}) and be >= {MIN_MESSAGE_BYTES}, got "
            f"{c.max_message_bytes}",
        ),
        (c.chunk_bytes >= 1, f"chunk_bytes must be >= 1, got {c.chunk_bytes}"),
        (
            c.max_concurrent_rpcs >= 1,
            f"max_concurrent_rpcs must be >= 1, got {c.max_concurrent_rpcs}",
        ),
        (
            c.max_concurrent_streams is None or c.max_concurrent_streams >= 0,
            f"max_concurrent_streams must be >= 0 (0: no limit), got "
            f"{c.max_concurrent_streams}",
        ),
        (
            c.gradient_pool_bytes >= 0,
            f"gradient_pool_bytes must be >= 0 (0: none), got {c.gradient_pool_bytes}",
        ),
        (
            c.stall_seconds > 0 and math.isfinite(c.stall_seconds),
            f"stall_seconds must be a finite number > 0, got {c.stall_seconds}",
        ),
        (
            c.lease_seconds > 0 and math.isfinite(c.lease_seconds),
            f"lease_seconds must be a finite number > 0, got {c.lease_seconds}",
        ),
        (
            c.snapshot_interval >= 0 and math.isfinite(c.snapshot_interval),
            f"snapshot_interval must be a finite number >= 0 (0: no periodic "
            f"snapshots), got {c.snapshot_interval}",
        ),
        (c.keep_snapshots >= 1, f"keep_snapshots must be >= 1, got {c.keep_snapshots}"),
        (
            c.metrics_port is None or 0 <= c.metrics_port <= 65535,
            f"metrics_port must be 1..65535 (0 picks a free one), got {c.metrics_port}",
        ),
        (
            c.health_port is None or 0 <= c.health_port <= 65535,
            f"health_port must be 1..65535 (0 picks a free one), got {c.health_port}",
        ),
        (
            c.data_port is None or 0 <= c.data_port <= 65535,
            f"data_port must be 1..65535 (0 picks a free one), got {c.data_port}",
        ),
        (
            c.data_port is None or not c.address.startswith("unix"),
            "data_port serves TCP beside a TCP address; on a unix: address use "
            "shared memory (the same host) instead",
        ),
        (
            c.durability in DURABILITY_MODES,
            f"durability must be one of {', '.join(DURABILITY_MODES)}, got "
            f"{c.durability!r}",
        ),
    ] + [
        (
            getattr(c, name) >= 0,
            f"{name} must be >= 0 (0: no limit), got {getattr(c, name)}",
        )
        for name in (
            "max_inflight_bytes",
            "max_group_bytes",
            "max_total_bytes",
            "max_groups",
        )
    ]


def validate_config(config: ServerConfig) -> None:
    """Refuse a configuration the server could not run as meant (``ConfigError``,
    naming the field and the value): called by ``ServerConfig`` itself."""
    _check_address(config.address)
    for holds, message in _checks(config):
        if not holds:
            raise ConfigError(message)
    if config.shard:
        parse_shard(config.shard)
    security.check_advertise_address(config)
    thread_limits(config)


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
        set_serving=set_serving,
        truncate_corrupt=config.wal_truncate_corrupt,
    )
    d.open()
    return d


def thread_limits(config: ServerConfig) -> tuple[int, int]:
    """(streams, waiting calls) at once: each holds a worker thread for as long as
    its client (or the version it waits for) takes, so together they stay below
    ``threads`` and the rest serve short calls and health checks."""
    threads = config.threads
    waiting = config.max_waiting_calls
    if waiting is None:
        waiting = max(1, threads // 4)
    streams = config.max_concurrent_streams
    if streams is None:
        streams = max(1, min(threads // 2, threads - waiting - 1))
    if not 1 <= waiting < threads:
        raise ConfigError(
            f"max_waiting_calls must be at least 1 and below --threads "
            f"({threads}), so waiting calls leave threads for the others; "
            f"got {waiting}"
        )
    if streams and streams + waiting >= threads:
        raise ConfigError(
            f"max_concurrent_streams ({streams}) + max_waiting_calls ({waiting}) "
            f"must be below --threads ({threads}), so that streams and waiting "
            "calls leave threads for short calls and health checks"
        )
    return streams, waiting


def create_server(config: ServerConfig | None = None) -> ServerHandle:
    """Build every part of a server and bind it, without starting it (port 0 picks a
    free port). This is the one place the parts are wired together."""
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
    interceptors.append(ShardInterceptor(shard))
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
            )
        )
    # A crash between a sync step's last push record and the step's own record leaves
    # a full quorum pending after replay: take such steps before serving anything.
    store.reap_leases()
    replication = _replication(
        config, shard, store, durability, recorder.registry, status.set_caught_up
    )
    metrics = None
    shared_memory = SharedMemory(enabled=config.shared_memory == "on")
    unix_socket = None
    data_channels = None
    try:
        if config.data_port is not None:
            host = config.address.rsplit(":", 1)[0].strip("[]")
            tls = None
            if config.tls_cert and config.tls_key:
                tls = tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            data_channels = DataChannels(
                host, config.data_port, tls, stall_seconds=config.stall_seconds
            )
        servicer = ParameterServerServicer(
            store,
            chunk_bytes=config.chunk_bytes,
            save=None if durability is None else durability.save,
            inflight=inflight,
            gradient_pool=gradient_pool,
            shared_memory=shared_memory,
            data_channels=data_channels,
            replicate=_replicate_of(replication),
        )
        _serve_frames(data_channels, chain, add_servicer(servicer, server))
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


def _serve_frames(
    data_channels: DataChannels | None, chain: HookChain, handlers: dict[str, Any]
) -> None:
    """Small Push and Pull as frames on the data channel's call channels."""
    if data_channels is not None:
        data_channels.frame_calls = FrameCalls(chain, handlers)


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
