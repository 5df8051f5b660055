"""The ``onnxps`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .app import ServerConfig, serve
from .security import ConfigError

__all__ = ["main"]


def _env(name: str, default: str) -> str:
    return os.environ.get(f"ONNXPS_{name}", default)


def _flag(
    p: argparse.ArgumentParser, name: str, env: str, default: Any, help: str, **kw: Any
) -> None:
    """A flag whose default comes from ONNXPS_<env>, named in its help."""
    value = os.environ.get(f"ONNXPS_{env}")
    kind = kw.get("type", str)
    if kw.get("action") == "store_true":
        default = default if value is None else value.lower() in ("1", "true", "yes")
    elif value is not None:
        default = kind(value)
    p.add_argument(
        name, default=default, help=f"{help} (ONNXPS_{env}; default {default!r})", **kw
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run a parameter server")
    _flag(p, "--address", "ADDRESS", "127.0.0.1:50051", "host:port to listen on")
    _flag(p, "--threads", "THREADS", 64, "RPC worker threads", type=int)
    _flag(p, "--log-level", "LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR")
    _flag(
        p,
        "--max-message-bytes",
        "MAX_MESSAGE_BYTES",
        256 << 20,
        "largest unary message",
        type=int,
    )
    _flag(p, "--chunk-bytes", "CHUNK_BYTES", 1 << 20, "stream chunk size", type=int)
    _flag(
        p,
        "--max-concurrent-rpcs",
        "MAX_CONCURRENT_RPCS",
        256,
        "calls in flight before RESOURCE_EXHAUSTED",
        type=int,
    )
    _flag(
        p,
        "--max-inflight-bytes",
        "MAX_INFLIGHT_BYTES",
        4 << 30,
        "request bytes handled at once before RESOURCE_EXHAUSTED, 0 for no limit",
        type=int,
    )
    _flag(
        p,
        "--max-concurrent-streams",
        "MAX_CONCURRENT_STREAMS",
        64,
        "streaming calls at once before RESOURCE_EXHAUSTED, 0 for no limit",
        type=int,
    )
    _flag(
        p,
        "--max-group-bytes",
        "MAX_GROUP_BYTES",
        0,
        "largest group (X with V/H), 0 for no limit",
        type=int,
    )
    _flag(
        p,
        "--max-total-bytes",
        "MAX_TOTAL_BYTES",
        0,
        "state the server holds in all, 0 for no limit",
        type=int,
    )
    _flag(
        p, "--max-groups", "MAX_GROUPS", 0, "number of groups, 0 for no limit", type=int
    )
    _flag(
        p,
        "--lease-seconds",
        "LEASE_SECONDS",
        10.0,
        "worker lease (sync quorum) when a group sets none",
        type=float,
    )
    _flag(p, "--data-dir", "DATA_DIR", "onnxps-data", "directory for snapshots and WAL")
    _flag(
        p,
        "--durability",
        "DURABILITY",
        "snapshot",
        "none, snapshot or wal",
        choices=["none", "snapshot", "wal"],
    )
    _flag(
        p,
        "--snapshot-interval",
        "SNAPSHOT_INTERVAL",
        300.0,
        "seconds between snapshots, 0 for none",
        type=float,
    )
    _flag(p, "--keep-snapshots", "KEEP_SNAPSHOTS", 3, "snapshots kept", type=int)
    _flag(p, "--tls-cert", "TLS_CERT", None, "server certificate (PEM)")
    _flag(p, "--tls-key", "TLS_KEY", None, "server private key (PEM)")
    _flag(
        p,
        "--tls-client-ca",
        "TLS_CLIENT_CA",
        None,
        "CA that client certificates must chain to (mutual TLS)",
    )
    _flag(
        p,
        "--tokens-file",
        "TOKENS_FILE",
        None,
        "token file: roles and group prefixes per token",
    )
    _flag(
        p,
        "--insecure",
        "INSECURE",
        False,
        "allow a non-loopback address without TLS and tokens",
        action="store_true",
    )
    _flag(
        p,
        "--metrics-port",
        "METRICS_PORT",
        None,
        "serve Prometheus metrics on this port",
        type=int,
    )


def _serve(args: argparse.Namespace) -> int:
    config = ServerConfig(
        address=args.address,
        threads=args.threads,
        max_message_bytes=args.max_message_bytes,
        chunk_bytes=args.chunk_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_inflight_bytes=args.max_inflight_bytes,
        max_concurrent_streams=args.max_concurrent_streams,
        max_group_bytes=args.max_group_bytes,
        max_total_bytes=args.max_total_bytes,
        max_groups=args.max_groups,
        lease_seconds=args.lease_seconds,
        data_dir=args.data_dir,
        durability=args.durability,
        snapshot_interval=args.snapshot_interval,
        keep_snapshots=args.keep_snapshots,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        tokens_file=args.tokens_file,
        insecure=args.insecure,
        metrics_port=args.metrics_port,
    )
    try:
        return serve(config)
    except ConfigError as exc:  # refused before binding: say why, no traceback
        print(f"onnxps: {exc}", file=sys.stderr)
        return 2


def _add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from . import demo

    demo.add_arguments(
        sub.add_parser("demo", help="train an MLP on digits with a server and workers")
    )


def _add_status(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from . import status

    status.add_arguments(
        sub.add_parser("status", help="show the groups on a running server")
    )


def _add_transfer(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="write groups of a running server to a file")
    p.add_argument("address", help="host:port of the server")
    p.add_argument("file", help="the .npz file to write")
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    _flag(p, "--token", "TOKEN", None, "bearer token")
    p = sub.add_parser("import", help="create the groups of an export file")
    p.add_argument("address", help="host:port of the server")
    p.add_argument("file", help="a file written by onnxps export")
    _flag(p, "--token", "TOKEN", None, "bearer token")


def _transfer(args: argparse.Namespace) -> int:
    from onnxps.client import Client

    with Client(args.address, token=args.token) as client:
        if args.command == "export":
            names = client.export(args.file, prefix=args.prefix)
            print(f"exported {len(names)} groups to {args.file}")
        else:
            names = client.import_(args.file)
            print(f"imported {len(names)} groups from {args.file}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="onnxps", description="onnxps: a gRPC parameter server for ONNX optimizers"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_transfer(sub)
    _add_demo(sub)
    _add_status(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        return _serve(args)
    if args.command in ("export", "import"):
        return _transfer(args)
    if args.command == "demo":
        from . import demo

        return demo.run(args)
    if args.command == "status":
        from . import status

        return status.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
