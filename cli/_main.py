"""``onnxps COMMAND``: dispatch to ``serve`` (the server) or a client command.

Every command reports a failure as one line on stderr: exit status 1 when it ran and
failed (server down, group exists), 2 for wrong flags or configuration, 130 when
interrupted. ``ONNXPS_DEBUG=1`` shows the traceback of an unexpected error.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from onnxps.server import cli as server_cli

from . import demo, status, transfer
from ._args import EXIT_FAILURE, CommandFailed, Parser, report

__all__ = ["main", "version"]


def version() -> str:
    try:
        return metadata.version("onnxps")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "unknown"


def _parser() -> Parser:
    parser = Parser(
        prog="onnxps", description="onnxps: a gRPC parameter server for ONNX optimizers"
    )
    parser.add_argument("--version", action="version", version=f"onnxps {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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


def _run(argv: Sequence[str] | None) -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except CommandFailed as exc:
        return report(exc)
    except KeyboardInterrupt:
        print("onnxps: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the last line of defence: one line, not a traceback
        if os.environ.get("ONNXPS_DEBUG"):
            raise
        print(
            f"onnxps: unexpected error: {type(exc).__name__}: {exc} "
            "(ONNXPS_DEBUG=1 shows the traceback; please report it)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
