"""What every channel and every client constructor is given and checks: channel
options (the one retry policy), credentials, and the arguments' checks."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from onnxps.wire.codec import (
    SERVICE,
    deserializer,
    rpc_messages,
    serializer,
)

from ._optimizers import Async, OptimizerSpec, Sync

__all__ = [
    "DEFAULT_PORT",
    "SWITCH_MODES",
    "channel_credentials",
    "channel_options",
    "check_client_arguments",
    "multicallable",
    "named_tensors",
    "spec",
    "with_default_port",
]

# The port ``onnxps serve`` listens on unless told otherwise; an address without a
# port means it (gRPC's own default would be 443, the HTTPS port).
DEFAULT_PORT = 50051


# The values of shared_memory= and data_channel=.
SWITCH_MODES = ("auto", "on", "off")

# The one retry mechanism for every call: the channel retries UNAVAILABLE (the server
# is down or draining), within the call's deadline. A push is also resent, with the
# same (client_id, seq), while UNAVAILABLE reaches the client after the channel gave
# up (e.g. a stream the channel cannot replay), until its deadline: the server applies
# it exactly once. The calls that are safe to repeat (reads, and pushes, which the
# server deduplicates) are also retried on CANCELLED: a server that stops cancels the
# calls it had received but not yet started, and none of them ran.
_SAFE_TO_REPEAT = (
    "Push",
    "PushStream",
    "PushPullStream",
    "Pull",
    "SharedMemoryHello",
    "PullStream",
    "DescribeGroup",
    "ListGroups",
    "Heartbeat",
    "Apply",
    "ApplyStream",
)


def _retry_policy(*codes: str) -> dict[str, Any]:
    return {
        "maxAttempts": 5,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": list(codes),
    }


_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": m} for m in _SAFE_TO_REPEAT],
            "retryPolicy": _retry_policy("UNAVAILABLE", "CANCELLED"),
        },
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": _retry_policy("UNAVAILABLE"),
        },
        # Not retried: a hello is for a channel beside gRPC, which the call that
        # asks for it goes without at once (over gRPC, with its own retries) when
        # the server is away, instead of spending its deadline on the hello's
        {"name": [{"service": SERVICE, "method": "DataChannelHello"}]},
    ]
}


# A restarted server is found within about two seconds (gRPC's default reconnect
# backoff grows to two minutes, longer than any push waits).
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# A client of a replicated cluster pings a server while a call waits on it: a frozen
# primary (SIGSTOP, a hung host, a partition) answers no ping, so the call fails
# UNAVAILABLE within about 2 s and is resent to the primary etcd names, instead of
# waiting out its whole deadline on a server that will never answer. (The servers
# take a ping a second: ``server.app``'s ``grpc.http2.*`` options.)
FOLLOW_KEEPALIVE: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.http2.ping_timeout_ms", 1000),  # (grpcio >= 1.5x: the ping's own)
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 0),
]


def channel_options(
    server_name_override: str | None, follows: bool = False
) -> list[tuple[str, Any]]:
    """The options of every channel either client opens. A client of a replicated
    cluster (``follows``) resends UNAVAILABLE itself, reading the primary in etcd
    again every 50 ms: gRPC's retries would back off (up to 1.5 s) against a
    primary that is gone; and it pings a server a call waits on
    (``FOLLOW_KEEPALIVE``)."""
    options = list(_CHANNEL_OPTIONS)
    if follows:
        options.remove(("grpc.enable_retries", 1))
        options.append(("grpc.enable_retries", 0))
        options.extend(FOLLOW_KEEPALIVE)
    if server_name_override:
        options.append(("grpc.ssl_target_name_override", server_name_override))
    return options


_TRANSPORTS = ("auto", "unary", "stream")


def with_default_port(address: str) -> str:
    """``address`` with ``:50051`` added when it names a host but no port:
    ``"localhost"``, ``"10.0.0.7"``, ``"[::1]"``, ``"::1"`` and ``"dns:///ps"``;
    other schemes (``unix:``) and addresses with a port are kept as they are."""
    text = address.strip()
    scheme = ""
    for prefix in ("dns:///", "dns:"):
        if text.startswith(prefix):
            scheme, text = prefix, text[len(prefix) :]
            break
    if not text or text.startswith(("unix:", "unix-abstract:", "vsock:", "ipv4:")):
        return address
    if text.startswith("ipv6:") or "/" in text:
        return address
    if text.startswith("["):
        if "]:" in text or not text.endswith("]"):
            return address
        return f"{scheme}{text}:{DEFAULT_PORT}"
    colons = text.count(":")
    if colons == 1:
        return address
    if colons == 0:
        return f"{scheme}{text}:{DEFAULT_PORT}"
    return f"{scheme}[{text}]:{DEFAULT_PORT}"  # a bare IPv6 address


def check_client_arguments(
    client: str,
    address: Any,
    timeout: Any,
    transport: Any,
    chunk_bytes: Any,
    root_certificates: Any,
    unexpected: Mapping[str, Any],
    shared_memory: Any = "off",
    data_channel: Any = "off",
    frames: Any = "off",
) -> None:
    """TypeError/ValueError that say what ``Client(...)`` (or ``AsyncClient``)
    takes."""
    if unexpected:
        names = ", ".join(sorted(unexpected))
        raise TypeError(
            f"{client}() got unexpected argument(s) {names}: it takes the server "
            "address ('host:port') and connection options (timeout=, token=, TLS, "
            "transport=); tensors are given to create_group(), gradients to push()"
        )
    if isinstance(address, list | tuple) and address:  # a cluster's shards
        bad = [a for a in address if not (isinstance(a, str) and a.strip())]
        if bad:
            raise TypeError(
                f"{client}(address): the server's 'host:port' as a string, or a "
                "cluster's shards as a list of them in shard order; the list holds "
                f"{type(bad[0]).__name__}"
            )
    elif not isinstance(address, str) or not address.strip():
        raise TypeError(
            f"{client}(address): the server's 'host:port' as a string, e.g. "
            f"{client}('127.0.0.1:50051'), or a cluster's shards as a list of them, "
            f"got {type(address).__name__}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout is seconds (a number), got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if transport not in _TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}"
        )
    for name, mode in (
        ("shared_memory", shared_memory),
        ("data_channel", data_channel),
        ("frames", frames),
    ):
        if mode not in SWITCH_MODES:
            raise ValueError(
                f"{name} must be one of {', '.join(SWITCH_MODES)}, got {mode!r}"
            )
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    if root_certificates is not None and not isinstance(root_certificates, bytes):
        raise TypeError(
            "root_certificates is the PEM bytes of the CA, not a path: pass "
            "open(path, 'rb').read()"
        )


def spec(value: Any, what: str, kind: Any = (Async, Sync)) -> Any:
    """``value`` when it is an instance of ``kind`` (or has its ``to_proto``); else
    a TypeError that says so (the class itself, ``Adam`` for ``Adam()``, is the usual
    slip)."""
    if isinstance(value, type):
        raise TypeError(
            f"{what} must be an instance, e.g. {value.__name__}(), not the class "
            f"{value.__name__}"
        )
    if not isinstance(value, kind) and not callable(getattr(value, "to_proto", None)):
        names = (
            "Adagrad(), Momentum(), Nesterov() or Adam()"
            if kind is OptimizerSpec
            else "Async() or Sync(workers)"
        )
        raise TypeError(f"{what} must be one of {names}, got {value!r}")
    return value


def named_tensors(tensors: Any) -> list[tuple[str, Any]]:
    """``{name: array}`` or ``[(name, array), ...]`` as a list of pairs."""
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        items = None
    else:
        items = list(tensors)
    if items is None or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items
    ):
        raise TypeError(
            "tensors must name each tensor, in the ONNX order: {'w': w0, 'b': b0} "
            "or [('w', w0), ('b', b0)]"
        )
    return items


def channel_credentials(
    tls: tuple[bytes | None, bytes | None, bytes | None],
) -> grpc.ChannelCredentials | None:
    """TLS credentials from (root certificates, private key, chain); None: plaintext."""
    roots, key, chain = tls
    if roots is None and chain is None:
        return None
    return grpc.ssl_channel_credentials(roots, key, chain)


def multicallable(channel: Any, method: str) -> Any:
    """``channel``'s callable for one RPC (blocking or ``grpc.aio``), whose stream
    messages may be encoded chunk frames (``codec.chunk_frames``) and whose received
    chunks are read as views (``codec.RawChunk``)."""
    request, reply, req_s, resp_s = rpc_messages(method)
    sends = "stream" if req_s else "unary"
    kind = f"{sends}_{'stream' if resp_s else 'unary'}"
    return getattr(channel, kind)(
        f"/{SERVICE}/{method}",
        request_serializer=serializer(request),
        response_deserializer=deserializer(reply),
        _registered_method=True,
    )
