"""``onnxps COMMAND``: dispatch to ``serve`` (the server) or a client command."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from onnxps.server import cli as server_cli

from . import demo, status, transfer

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnxps", description="onnxps: a gRPC parameter server for ONNX optimizers"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    server_cli.add_serve_arguments(
        sub.add_parser("serve", help="run a parameter server")
    )
    transfer.add_export_arguments(
        sub.add_parser("export", help="write groups of a running server to a file")
    )
    transfer.add_import_arguments(
        sub.add_parser("import", help="create the groups of an export file")
    )
    demo.add_arguments(
        sub.add_parser("demo", help="train an MLP on digits with a server and workers")
    )
    status.add_arguments(
        sub.add_parser("status", help="show the groups on a running server")
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return server_cli.run(args)
    logging.basicConfig(
        level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command in ("export", "import"):
        return transfer.run(args)
    if args.command == "demo":
        return demo.run(args)
    return status.run(args)
