"""``onnxps serve``: its flags, generated from ``ServerConfig``, and its run.

The other commands act as clients and live in ``onnxps.cli``.
"""

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

from ._wal import WalFormatError
from .app import ServerConfig, serve
from .security import ConfigError

__all__ = [
    "Flag",
    "add_serve_arguments",
    "config_flags",
    "config_from_args",
    "main",
    "run",
]


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
    """The serve flags; a flag's default comes from its ONNXPS_* variable if set
    (checked like the flag, when ``serve`` parses its arguments)."""
    environ = os.environ if environ is None else environ
    for flag in config_flags():
        default = flag.default
        if flag.env in environ:
            default = environ[flag.env]
            if flag.kind is bool:
                default = flag.parse(default)
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
                type=_typed(flag, environ),
                default=default,
                help=help,
                metavar=flag.name.upper(),
            )


def _typed(flag: Flag, environ: Mapping[str, str]) -> Any:
    """``flag.parse`` with argparse's one-line error (naming the variable when the
    value came from it)."""

    def parse(text: str) -> Any:
        try:
            return flag.parse(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            what = f"{text!r} is not a valid {flag.kind.__name__}"
            if isinstance(exc, argparse.ArgumentTypeError):
                what = str(exc)
            if environ.get(flag.env) == text:  # argparse names the flag
                what += f" (from {flag.env})"
            raise argparse.ArgumentTypeError(what) from None

    parse.__name__ = flag.kind.__name__
    return parse


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in config_flags()})


def run(args: argparse.Namespace) -> int:
    """``onnxps serve``: configure logging, serve until a signal, exit status: 0
    after a graceful stop, 2 for a configuration it refuses (a file it was
    given and cannot read too), 1 when it cannot start
    (port or data directory in use). Each failure is one line
    on stderr."""
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return serve(config_from_args(args))
    except (ConfigError, WalFormatError) as exc:  # refused before binding: say why
        print(f"onnxps: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"onnxps: {_os_error(exc)}", file=sys.stderr)
        return 2 if exc.filename is not None else 1  # a file it was told to read


def _os_error(exc: OSError) -> str:
    if exc.strerror is None:
        return str(exc)
    if exc.filename is not None:
        return f"cannot read {exc.filename}: {exc.strerror}"
    return exc.strerror


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onnxps.server.cli [FLAGS]``: the same as ``onnxps serve``."""
    parser = _Parser(prog="onnxps serve", description="run an onnxps parameter server")
    add_serve_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
