"""What every ``onnxps`` command shares: a parser whose mistakes are one line, the
checked number types, and the connection flags of the client commands."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the client (grpc, numpy) loads with the commands that use it
    from onnxps.client import RpcError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "Parser",
    "add_connection_arguments",
    "at_least",
    "fail",
    "positive_float",
    "read_tls_ca",
    "unreachable",
]

EXIT_FAILURE = 1  # the command ran and failed (server down, group exists, ...)
EXIT_USAGE = 2  # the command was given wrong flags or a wrong configuration


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reports a usage mistake in one line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_connection_arguments(p: argparse.ArgumentParser, timeout: float = 10.0) -> None:
    """``--timeout``, ``--token``, ``--tls-ca``: how a client command reaches a
    server."""
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=timeout,
        help=f"seconds each call may take (default {timeout:g})",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("ONNXPS_TOKEN"),
        help="bearer token (ONNXPS_TOKEN)",
    )
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("ONNXPS_TLS_CA"),
        help="CA certificate (PEM) to connect with TLS (ONNXPS_TLS_CA)",
    )


def read_tls_ca(prog: str, path: str | None) -> bytes | None:
    """The CA file's bytes; a missing file ends the command with one line."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        fail(prog, f"cannot read the TLS CA file {path}: {exc.strerror}", EXIT_USAGE)


class CommandFailed(Exception):
    """Raised by ``fail``; ``onnxps`` prints ``message`` and exits with ``status``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def fail(prog: str, message: str, status: int = EXIT_FAILURE) -> NoReturn:
    raise CommandFailed(f"{prog}: {message}", status)


def report(exc: CommandFailed, stream: Any = None) -> int:
    print(str(exc), file=stream or sys.stderr)
    return exc.status


def unreachable(
    exc: RpcError, address: str | Sequence[str], timeout: float
) -> str | None:
    """For a call that failed with ``exc``: why the first server of ``address``
    that cannot be connected to cannot be (``"UNAVAILABLE: cannot connect to
    127.0.0.1:1: Connection refused"``); None when ``exc`` is another refusal, or
    every server accepts a TCP connection (or is not host:port).

    A call that fails to connect ends in UNAVAILABLE, or in DEADLINE_EXCEEDED when
    its deadline comes before the channel gives up: one cause, so the commands
    ask the socket and say the same thing for both."""
    from onnxps.client._replies import tcp_host
    from onnxps.client._settings import with_default_port

    if exc.code.name not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return None
    addresses = [address] if isinstance(address, str) else list(address)
    for a in (with_default_port(a) for a in addresses):
        host = tcp_host(a)
        if host is None:
            continue
        port = int(a.rpartition(":")[2])
        try:
            socket.create_connection((host, port), timeout=min(timeout, 2.0)).close()
        except OSError as exc:
            return f"UNAVAILABLE: cannot connect to {a}: {exc.strerror or exc}"
    return None
