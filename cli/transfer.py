"""``onnxps export`` and ``onnxps import``: groups to and from one file, whose format
follows its extension: ``.npz`` (groups with their optimizer state), ``.safetensors``
and ``.onnx`` (model weights: ``onnxps.client._weights``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from onnxps.client import Client, OnnxpsError, RpcError
from onnxps.client._cluster import parse_target
from onnxps.client._transfer import ExportFileError, ImportResult, import_groups
from onnxps.client._weights import export_weights_op, import_weights_op
from onnxps.wire.weights import MissingExtraError, file_format

from ._args import (
    EXIT_FAILURE,
    EXIT_USAGE,
    add_connection_arguments,
    fail,
    positive_float,
    read_tls_ca,
    unreachable,
)
from ._bytes_progress import BytesProgress
from ._demo_worker import OPTIMIZERS, optimizer_spec

__all__ = ["add_export_arguments", "add_import_arguments", "plural", "run"]

_ADDRESS = (
    "host:port of the server (port 50051 when omitted), or of every shard of a "
    "cluster in shard order, comma-separated (a cluster exports to one file and "
    "imports into any shard count)"
)


def plural(n: int, noun: str) -> str:
    """``1 group``, ``2 groups``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show progress on stderr (.safetensors, .onnx; default: for models of "
        "64 MiB and more)",
    )


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help=_ADDRESS)
    p.add_argument(
        "file",
        help="the file to write; its extension says the format: .safetensors (the "
        "tensors, by name), .onnx (written into a copy of --model), any other (.npz) "
        "the groups with their optimizer state, for onnxps import",
    )
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    p.add_argument("--group", help="only this group")
    p.add_argument(
        "--model",
        metavar="BASE.onnx",
        help="the ONNX model whose initializers the groups' tensors are: FILE is a "
        "copy of it with the trained values (an export to .onnx)",
    )
    _add_progress(p)
    add_connection_arguments(p)


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help=_ADDRESS)
    p.add_argument(
        "file",
        help="a file written by onnxps export (.npz, .safetensors), a .safetensors "
        "file of a model, or an .onnx model (its float initializers)",
    )
    p.add_argument(
        "--group",
        help="only this group of the file; for a model's file, the group to create "
        "or write into (default: the file's name without its extension)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="the optimizer of a group created from a .safetensors or .onnx file "
        "(default: the one the file names, an onnxps export's or an ONNX model's "
        "optimizer node; momentum and nesterov: alpha 0.9, beta 1)",
    )
    p.add_argument(
        "--learning-rate",
        type=positive_float,
        metavar="R",
        help="the learning rate of a group created from a .safetensors or .onnx file "
        "(default: the one the file names)",
    )
    existing = p.add_mutually_exclusive_group()
    existing.add_argument(
        "--skip-existing",
        dest="existing",
        action="store_const",
        const="skip",
        default="fail",
        help="(.npz) leave the groups the server already has as they are",
    )
    existing.add_argument(
        "--replace",
        dest="existing",
        action="store_const",
        const="replace",
        help="(.npz) delete the groups the server already has and create them from "
        "the file",
    )
    _add_progress(p)
    add_connection_arguments(p)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def _export(client: Client, args: argparse.Namespace, out: TextIO) -> None:
    if file_format(args.file) == "npz":
        names = client.export(args.file, prefix=args.prefix, group=args.group)
        print(f"exported {plural(len(names), 'group')} to {args.file}", file=out)
        return
    progress = BytesProgress(sys.stderr, args.progress)
    try:
        done = client._run(
            export_weights_op(
                client,
                args.file,
                group=args.group,
                prefix=args.prefix,
                model=args.model,
                progress=progress,
            )
        )
    finally:
        progress.close()
    line = f"exported {plural(len(done.groups), 'group')} "
    if args.model is None:
        line += f"({plural(len(done.tensors), 'tensor')}) to {args.file}"
    else:
        line += (
            f"to {args.file} ({plural(len(done.tensors), 'initializer')} written into "
            f"a copy of {args.model}"
        )
        if done.kept:
            line += (
                f"; {plural(len(done.kept), 'float initializer')} left as "
                f"{'it was' if len(done.kept) == 1 else 'they were'}: "
                f"{_names(done.kept)}"
            )
        line += ")"
    print(line, file=out)


def _import(client: Client, args: argparse.Namespace, out: TextIO) -> None:
    if file_format(args.file) == "npz":
        result = import_groups(
            client, args.file, existing=args.existing, group=args.group
        )
    else:
        progress = BytesProgress(sys.stderr, args.progress)
        try:
            result = client._run(
                import_weights_op(
                    client,
                    args.file,
                    group=args.group,
                    optimizer=optimizer_spec(args.optimizer)
                    if args.optimizer
                    else None,
                    learning_rate=args.learning_rate,
                    progress=progress,
                )
            )
        finally:
            progress.close()
    print(_imported(args.file, result), file=out)


def _imported(file: str, result: ImportResult) -> str:
    line = f"imported {plural(len(result.imported), 'group')} from {file}"
    parts = []
    if result.created:
        parts.append(f"created {_names(result.created)}")
    if result.replaced:
        parts.append(f"replaced {_names(result.replaced)}")
    if result.updated:
        parts.append(f"wrote into {_names(result.updated)}")
    if result.skipped:
        parts.append(f"skipped {plural(len(result.skipped), 'existing group')}: ")
        parts[-1] += _names(result.skipped)
    if result.left_out:
        parts.append(
            f"left out {plural(len(result.left_out), 'tensor')}: "
            + ", ".join(f"{n} ({d})" for n, d in result.left_out)
        )
    return line + (f" ({'; '.join(parts)})" if parts else "")


def _usage(args: argparse.Namespace) -> str | None:
    """A flag that does not go with the file's format: what to do instead."""
    fmt = file_format(args.file)
    if args.command == "export":
        if fmt == "onnx" and args.model is None:
            return (
                f"an export to {args.file} writes the trained values into a copy of "
                "an ONNX model: name that model with --model BASE.onnx"
            )
        if fmt != "onnx" and args.model is not None:
            return "--model is for an export to an .onnx file"
        return None
    if fmt == "npz" and (args.optimizer or args.learning_rate is not None):
        return (
            f"{args.file} says how its groups are trained: --optimizer and "
            "--learning-rate are for .safetensors and .onnx files"
        )
    if fmt != "npz" and args.existing != "fail":
        flag = "--skip-existing" if args.existing == "skip" else "--replace"
        return (
            f"{flag} is for .npz files: a .safetensors or .onnx import writes into "
            "a group the server has (same tensors) or refuses"
        )
    return None


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
    wrong = _usage(args)
    if wrong:
        fail(prog, wrong, EXIT_USAGE)
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
    except MissingExtraError as exc:
        fail(prog, str(exc))
    except RpcError as exc:
        why = unreachable(exc, parse_target(args.address), args.timeout)
        fail(prog, f"{args.address}: {why or exc}")
    except OnnxpsError as exc:
        fail(prog, f"{args.address}: {exc}")
    except OSError as exc:  # export: the file cannot be written
        fail(prog, f"cannot write {args.file}: {exc.strerror or exc}", EXIT_FAILURE)
    return 0
