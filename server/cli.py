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

from .app import serve
from .config import ServerConfig
from .durability._wal import WalFormatError
from .interceptors.security import ConfigError

__all__ = [
    "GROUPS",
    "Flag",
    "add_serve_arguments",
    "config_flags",
    "config_from_args",
    "format_bytes",
    "main",
    "parse_bytes",
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
    group: str = "other"  # its section of --help and of docs/configuration.md
    none: str | None = None  # what a None default means

    @property
    def is_bytes(self) -> bool:
        return self.kind is int and self.name.endswith("_bytes")

    @property
    def is_seconds(self) -> bool:
        return self.kind is float and (
            self.name.endswith("_seconds") or self.name.endswith("_interval")
        )

    @property
    def metavar(self) -> str:
        if self.choices:
            return "{" + ",".join(self.choices) + "}"
        if self.is_bytes:
            return "SIZE"
        if self.is_seconds:
            return "SECONDS"
        if self.name.endswith("_port"):
            return "PORT"
        return self.name.upper()

    def shown(self, value: Any) -> str:
        """``value`` as people read it: 256 MiB, 30 s, what None means."""
        if value is None:
            return self.none or "none"
        if isinstance(value, bool) or self.kind is bool:
            return "on" if value else "off"
        if self.is_bytes and isinstance(value, int):
            return format_bytes(value)
        if self.is_seconds and isinstance(value, int | float):
            return f"{value:g} s"
        return str(value)

    def parse(self, text: str) -> Any:
        if self.kind is bool:
            return text.strip().lower() in ("1", "true", "yes", "on")
        if self.is_bytes:
            return parse_bytes(text)
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


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def format_bytes(n: int) -> str:
    """``268435456`` -> ``256 MiB``: the largest unit that divides it exactly."""
    for suffix, unit in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {suffix}"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} bytes" if n else "0"


def parse_bytes(text: str) -> int:
    """A byte count: ``1048576``, ``256MiB``, ``256 MiB``, ``4G`` (units of 1024)."""
    raw = text.strip().lower().replace(" ", "")
    for tail in ("ib", "b"):
        if raw.endswith(tail) and raw[: -len(tail)][-1:].isalpha():
            raw = raw[: -len(tail)]
            break
    unit = _UNITS.get(raw[-1:], None) if raw[-1:].isalpha() else 1
    number = raw[:-1] if raw[-1:].isalpha() else raw
    if unit is None or not number.removeprefix("-").isdigit():
        raise ValueError(f"{text!r} is not a byte count (e.g. 1048576, 256MiB, 4GiB)")
    return int(number) * unit  # a negative one is ServerConfig's to refuse


# The sections of ``onnxps serve --help``, in order, and what each holds.
GROUPS = {
    "network": "where the server listens and how tensors travel",
    "security": "TLS and tokens (docs/SECURITY.md)",
    "durability": "how state outlives the process (docs/durability.md)",
    "limits": "calls, threads and messages (docs/limits.md)",
    "memory": "state and buffers the server holds",
    "training": "workers of sync groups",
    "cluster": "sharding (docs/cluster.md)",
    "replication": "replicated shards on etcd (docs/cluster.md)",
    "observability": "logs, metrics and health (docs/metrics.md)",
    "other": "other settings",
}


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
                group=f.metadata.get("group") or "other",
                none=f.metadata.get("none"),
            )
        )
    return flags


def add_serve_arguments(
    p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """The serve flags; a flag's default comes from its ONNXPS_* variable if set
    (checked like the flag, when ``serve`` parses its arguments)."""
    environ = os.environ if environ is None else environ
    flags = config_flags()
    p.usage = "%(prog)s [FLAGS]  (each also read from its ONNXPS_* variable)"
    sections = {
        name: p.add_argument_group(name, about)
        for name, about in GROUPS.items()
        if any(f.group == name for f in flags)
    }
    for flag in flags:
        default = flag.default
        shown = f"default {flag.shown(default)}"
        if flag.env in environ:
            default = environ[flag.env]
            shown = f"{default!r} from {flag.env}"
            if flag.kind is bool:
                default = flag.parse(default)
        else:
            shown = f"{flag.env}; {shown}"
        help = f"{flag.meaning} ({shown})".replace("%", "%%")
        into = sections.get(flag.group, p)
        if flag.kind is bool:
            into.add_argument(
                flag.flag,
                dest=flag.name,
                action="store_true",
                default=default,
                help=help,
            )
        else:
            into.add_argument(
                flag.flag,
                dest=flag.name,
                type=_typed(flag, environ),
                default=default,
                help=help,
                metavar=flag.metavar,
            )


def _typed(flag: Flag, environ: Mapping[str, str]) -> Any:
    """``flag.parse`` with argparse's one-line error (naming the variable when the
    value came from it)."""

    def parse(text: str) -> Any:
        try:
            return flag.parse(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            what = f"{text!r} is not a valid {flag.kind.__name__}"
            if isinstance(exc, argparse.ArgumentTypeError) or flag.is_bytes:
                what = str(exc)  # a size says what sizes look like
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
