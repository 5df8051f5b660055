"""A server's configuration: ``ServerConfig`` and the checks that refuse one.

Every field carries the help text its ``onnxps serve`` flag and ``ONNXPS_*``
variable are generated from; ``validate_config`` and ``thread_limits`` refuse a
configuration the server could not run as meant, naming the field and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from onnxps.wire.codec import CHUNK_BYTES

from .durability import MODES as DURABILITY_MODES
from .interceptors import security
from .interceptors.security import ConfigError
from .interceptors.shard import parse_shard
from .transports._unix import socket_mode

__all__ = [
    "MESSAGE_OVERHEAD",
    "MIN_MESSAGE_BYTES",
    "ServerConfig",
    "thread_limits",
    "validate_config",
]


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
    shared_memory_idle_seconds: float = _option(
        1.0,
        "a client segment's pages leave this server's memory (they stay in the "
        "client's segment) once no call has used it this long, and the next call "
        "faults them in again: raise it where workers push large groups less "
        "often than this",
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
    keep_snapshots: int = _option(
        3,
        "snapshots kept (the newest N); with the write-ahead log since the oldest "
        "one kept, they are how far back a group can be rewound or forked",
        group="durability",
    )
    keep_seconds: float = _option(
        0.0,
        "keep also every snapshot younger than this many seconds (a rewind window "
        "in time), 0 for none",
        group="durability",
    )
    keep_bytes: int = _option(
        0,
        "at most this many bytes of snapshots and write-ahead log: the oldest "
        "snapshots beyond the newest one go first, whatever --keep-snapshots and "
        "--keep-seconds keep; 0 for no limit",
        group="durability",
    )
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
    data_port: str | int | None = _option(
        "auto",
        "also serve a data channel on this TCP port of the address's host: clients "
        "send small pushes and pulls on it as frames (about 3x less server CPU than "
        "gRPC) and large tensors' bytes beside gRPC, TLS with the server's "
        "certificate when it serves TLS, tickets from the authenticated gRPC hello; "
        "auto picks a free port and tells clients in the hello (none on a unix: "
        "address), off serves none (clients then use gRPC and shared memory only); "
        "behind a firewall or NetworkPolicy give a fixed port and open it, or off",
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
        "restarts (1 to 128 characters of [A-Za-z0-9._:@-], the first a letter or "
        "a digit)",
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

    @property
    def data_port_number(self) -> int | None:
        """The port the data channel listens on (0: a free one), None for none:
        ``data_port`` read (auto: a free port beside a TCP address)."""
        if self.data_port == "auto":
            return None if self.address.startswith("unix") else 0
        return _data_port_number(self.data_port)


def _data_port_number(value: str | int | None) -> int | None:
    """``--data-port`` as a port (0: a free one), None for off, -1 for neither."""
    if value is None or value == "off":
        return None
    if value == "auto":
        return 0
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else -1
    if isinstance(value, bool) or not 0 <= value <= 65535:
        return -1
    return value


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
        (
            c.shared_memory_idle_seconds > 0
            and math.isfinite(c.shared_memory_idle_seconds),
            "shared_memory_idle_seconds must be a finite number > 0, got "
            f"{c.shared_memory_idle_seconds}",
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
            c.keep_seconds >= 0 and math.isfinite(c.keep_seconds),
            f"keep_seconds must be a finite number >= 0, got {c.keep_seconds}",
        ),
        (c.keep_bytes >= 0, f"keep_bytes must be >= 0, got {c.keep_bytes}"),
        (
            c.metrics_port is None or 0 <= c.metrics_port <= 65535,
            f"metrics_port must be 1..65535 (0 picks a free one), got {c.metrics_port}",
        ),
        (
            c.health_port is None or 0 <= c.health_port <= 65535,
            f"health_port must be 1..65535 (0 picks a free one), got {c.health_port}",
        ),
        (
            _data_port_number(c.data_port) != -1,
            f"data_port must be auto, off or a port 1..65535 (0 picks a free one), "
            f"got {c.data_port!r}",
        ),
        (
            c.data_port in (None, "auto", "off") or not c.address.startswith("unix"),
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
