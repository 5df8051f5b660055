"""``onnxps export`` and ``onnxps import``: groups to and from one .npz file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from onnxps.client import Client, OnnxpsError, RpcError
from onnxps.client._cluster import parse_target
from onnxps.client._transfer import ExportFileError, import_groups

from ._args import (
    EXIT_FAILURE,
    add_connection_arguments,
    fail,
    read_tls_ca,
    unreachable,
)

__all__ = ["add_export_arguments", "add_import_arguments", "plural", "run"]

_ADDRESS = (
    "host:port of the server (port 50051 when omitted), or of every shard of a "
    "cluster in shard order, comma-separated (a cluster exports to one file and "
    "imports into any shard count)"
)


def plural(n: int, noun: str) -> str:
    """``1 group``, ``2 groups``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help=_ADDRESS)
    p.add_argument("file", help="the .npz file to write")
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    add_connection_arguments(p)


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help=_ADDRESS)
    p.add_argument("file", help="a file written by onnxps export")
    existing = p.add_mutually_exclusive_group()
    existing.add_argument(
        "--skip-existing",
        dest="existing",
        action="store_const",
        const="skip",
        default="fail",
        help="leave the groups the server already has as they are",
    )
    existing.add_argument(
        "--replace",
        dest="existing",
        action="store_const",
        const="replace",
        help="delete the groups the server already has and create them from the file",
    )
    add_connection_arguments(p)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def _export(client: Client, args: argparse.Namespace, out: TextIO) -> None:
    names = client.export(args.file, prefix=args.prefix)
    print(f"exported {plural(len(names), 'group')} to {args.file}", file=out)


def _import(client: Client, args: argparse.Namespace, out: TextIO) -> None:
    result = import_groups(client, args.file, existing=args.existing)
    line = f"imported {plural(len(result.imported), 'group')} from {args.file}"
    parts = []
    if result.created:
        parts.append(f"created {_names(result.created)}")
    if result.replaced:
        parts.append(f"replaced {_names(result.replaced)}")
    if result.skipped:
        parts.append(f"skipped {plural(len(result.skipped), 'existing group')}: ")
        parts[-1] += _names(result.skipped)
    print(line + (f" ({'; '.join(parts)})" if parts else ""), file=out)


def _clash(file: str, existing: Sequence[str]) -> str:
    return (
        f"the server already has {plural(len(existing), 'group')} of {file}: "
        f"{_names(existing)}; nothing was imported (--skip-existing keeps the "
        "server's, --replace deletes them and imports the file's)"
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Export or import; a failure is one line on stderr (see ``onnxps._args``)."""
    out = out or sys.stdout
    prog = f"onnxps {args.command}"
    roots = read_tls_ca(prog, args.tls_ca)
    try:
        with Client(
            parse_target(args.address),
            timeout=args.timeout,
            token=args.token,
            root_certificates=roots,
        ) as client:
            (_export if args.command == "export" else _import)(client, args, out)
    except ExportFileError as exc:
        if exc.existing:  # the library's words name its arguments; these, the flags
            fail(prog, _clash(args.file, exc.existing))
        fail(prog, str(exc))
    except RpcError as exc:
        why = unreachable(exc, parse_target(args.address), args.timeout)
        fail(prog, f"{args.address}: {why or exc}")
    except OnnxpsError as exc:
        fail(prog, f"{args.address}: {exc}")
    except OSError as exc:  # export: the file cannot be written
        fail(prog, f"cannot write {args.file}: {exc.strerror or exc}", EXIT_FAILURE)
    return 0
