"""``onnxps COMMAND``: dispatch to ``serve`` (the server) or a client command.

Every command reports a failure as one line on stderr: exit status 1 when it ran and
failed (server down, group exists), 2 for wrong flags or configuration, 130 when
interrupted. ``ONNXPS_DEBUG=1`` shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

from ._args import EXIT_FAILURE, CommandFailed, Parser, report

__all__ = ["main", "version"]

# Each command: the module that adds its arguments and runs it (``run(args)``), the
# function that adds them, its help. A command's module loads only when it is the
# one given: ``onnxps --version`` loads neither the server nor the client.
COMMANDS = {
    "serve": ("onnxps.server.cli", "add_serve_arguments", "run a parameter server"),
    "export": (
        "onnxps.cli.transfer",
        "add_export_arguments",
        "write groups of a running server to a file",
    ),
    "import": (
        "onnxps.cli.transfer",
        "add_import_arguments",
        "create the groups of an export file",
    ),
    "demo": (
        "onnxps.cli.demo",
        "add_arguments",
        "train an MLP on digits with a server and workers",
    ),
    "status": (
        "onnxps.cli.status",
        "add_arguments",
        "show the groups on a running server",
    ),
    "rewind": (
        "onnxps.cli.history",
        "add_rewind_arguments",
        "set a group back to its state right after an earlier step",
    ),
    "fork": (
        "onnxps.cli.history",
        "add_fork_arguments",
        "create a group with another's state right after one of its steps",
    ),
    "history": (
        "onnxps.cli.history",
        "add_history_arguments",
        "list the steps a group can go back to, with their times",
    ),
}


def version() -> str:
    try:
        return metadata.version("onnxps")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "unknown"


def _command(argv: Sequence[str]) -> str | None:
    """The command named in ``argv`` (its first word that is not an option: the
    top level's options, --version and --help, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


@dataclass
class _Chosen:
    """The command given: its module and its own parser."""

    module: ModuleType
    parser: argparse.ArgumentParser


def _parser(command: str | None) -> tuple[Parser, _Chosen | None]:
    """The parser, with the arguments of ``command`` only, and that command's
    module and parser (None when ``command`` is none of them)."""
    parser = Parser(
        prog="onnxps", description="onnxps: a gRPC parameter server for ONNX optimizers"
    )
    parser.add_argument("--version", action="version", version=f"onnxps {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None
    for name, (module_name, add_arguments, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == command:
            chosen = _Chosen(importlib.import_module(module_name), p)
            getattr(chosen.module, add_arguments)(p)
    return parser, chosen


def _unknown(parser: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """What the command says of arguments it does not take: which, and the flag
    that was probably meant (``--port``: ``--address HOST:PORT``)."""
    flags = [f for a in parser._actions for f in a.option_strings]  # noqa: SLF001
    hints = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        if name in ("--port", "--host") and "--address" in flags:
            hints.append(f"{name}: use --address HOST:PORT")
        elif close := difflib.get_close_matches(name, flags, n=1, cutoff=0.75):
            hints.append(f"{name}: did you mean {close[0]}?")
    said = f"unrecognized arguments: {' '.join(extra)}"
    return f"{said} ({'; '.join(hints)})" if hints else said


def _run(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    if command != "serve" and "grpc" not in sys.modules:
        # gRPC's C core logs each failed TLS handshake at INFO on stderr, before the
        # one line a client command prints; set before grpc loads (GRPC_VERBOSITY=INFO
        # shows them again). A server keeps them: a rejected peer's certificate is
        # in its log. Called in a process where grpc is loaded already (a program
        # or a test calling main()), it would change nothing for this command and
        # only reach the servers that process starts next: left alone.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser, chosen = _parser(command)
    args, extra = parser.parse_known_args(argv)
    assert chosen is not None  # parse_known_args exits on a command it does not know
    if extra:  # said by the command's parser, whose --help lists its flags
        chosen.parser.error(_unknown(chosen.parser, extra))
    module = chosen.module
    if args.command != "serve":
        logging.basicConfig(
            level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    run: int = module.run(args)
    return run


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
