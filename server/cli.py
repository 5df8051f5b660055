"""The ``onnxps`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .app import ServerConfig, serve
from .security import ConfigError

__all__ = ["main"]


@dataclass(frozen=True)
class Flag:
    """One ``onnxps serve`` flag, made from a ``ServerConfig`` field."""

    name: str  # the field
    flag: str  # --field-name
    env: str  # ONNXPS_FIELD_NAME
    kind: type  # str, int, float or bool (None allowed when the default is None)
    default: Any
    help: str
    choices: tuple[str, ...] | None

    def parse(self, text: str) -> Any:
        if self.kind is bool:
            return text.strip().lower() in ("1", "true", "yes", "on")
        if self.choices:
            for choice in self.choices:
                if text.lower() == choice.lower():
                    return choice
            raise argparse.ArgumentTypeError(
                f"{text!r} is not one of {', '.join(self.choices)}"
            )
        return self.kind(text)

    @property
    def meaning(self) -> str:
        if not self.choices:
            return self.help
        return f"{self.help}: {', '.join(self.choices[:-1])} or {self.choices[-1]}"


def config_flags() -> list[Flag]:
    """The flags of ``onnxps serve``, one per ``ServerConfig`` field, in order."""
    hints = typing.get_type_hints(ServerConfig)
    flags = []
    for f in dataclasses.fields(ServerConfig):
        kinds = [k for k in typing.get_args(hints[f.name]) if k is not type(None)]
        flags.append(
            Flag(
                name=f.name,
                flag="--" + f.name.replace("_", "-"),
                env="ONNXPS_" + f.name.upper(),
                kind=kinds[0] if kinds else hints[f.name],
                default=f.default,
                help=f.metadata["help"],
                choices=f.metadata.get("choices"),
            )
        )
    return flags


def add_serve_arguments(
    p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """The serve flags; a flag's default comes from its ONNXPS_* variable if set."""
    environ = os.environ if environ is None else environ
    for flag in config_flags():
        default = flag.default
        if flag.env in environ:
            default = flag.parse(environ[flag.env])
        help = f"{flag.meaning} ({flag.env}; default {default!r})"
        if flag.kind is bool:
            p.add_argument(
                flag.flag,
                dest=flag.name,
                action="store_true",
                default=default,
                help=help,
            )
        else:
            p.add_argument(
                flag.flag,
                dest=flag.name,
                type=flag.parse,
                default=default,
                help=help,
                metavar=flag.name.upper(),
            )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in config_flags()})


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    add_serve_arguments(sub.add_parser("serve", help="run a parameter server"))


def _serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
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


_TOKEN = "bearer token (ONNXPS_TOKEN)"


def _add_transfer(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="write groups of a running server to a file")
    p.add_argument("address", help="host:port of the server")
    p.add_argument("file", help="the .npz file to write")
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    p.add_argument("--token", default=os.environ.get("ONNXPS_TOKEN"), help=_TOKEN)
    p = sub.add_parser("import", help="create the groups of an export file")
    p.add_argument("address", help="host:port of the server")
    p.add_argument("file", help="a file written by onnxps export")
    p.add_argument("--token", default=os.environ.get("ONNXPS_TOKEN"), help=_TOKEN)


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
